"""Chat templates: a conversation (role/content messages) rendered as the text a model reads.

A model fine-tuned with one template is prompted with the same one (`sft.chat_template`, saved in
the run's config.json), so SFT, generation, evaluation and RL all render through here. Special
tokens are written as text; a tokenizer that has them as pieces (LLaDA's, Qwen's) maps them to
their ids, others spell them out.
"""

from __future__ import annotations

import dataclasses

from dlmjax import config as config_lib
from dlmjax.data.errors import DataError


@dataclasses.dataclass(frozen=True)
class Template:
  """turns[role] = (text before the content, text after it); `generation` opens the reply."""

  turns: dict
  generation: str
  begin: str = ''  # once, before the first message (a BOS written as text).
  # A system message rendered first when the conversation has none (Qwen2's template does this).
  default_system: str = ''


TEMPLATES: dict[str, Template] = {
  # Raw text: contents concatenated as they are (the data carries its own formatting).
  'none': Template(turns={r: ('', '') for r in ('system', 'user', 'assistant')}, generation=''),
  'plain': Template(
    turns={
      'system': ('System: ', '\n'),
      'user': ('User: ', '\n'),
      'assistant': ('Assistant: ', '\n'),
    },
    generation='Assistant: ',
  ),
  # LLaDA-8B-Instruct (Llama-3 headers): <BOS><|start_header_id|>user<|end_header_id|>\n\n...
  'llada': Template(
    turns={
      r: (f'<|start_header_id|>{r}<|end_header_id|>\n\n', '<|eot_id|>')
      for r in ('system', 'user', 'assistant')
    },
    generation='<|start_header_id|>assistant<|end_header_id|>\n\n',
    begin='<|startoftext|>',
  ),
  # Qwen (ChatML).
  'chatml': Template(
    turns={r: (f'<|im_start|>{r}\n', '<|im_end|>\n') for r in ('system', 'user', 'assistant')},
    generation='<|im_start|>assistant\n',
  ),
  # Dream-v0-Instruct-7B / DiffuCoder-Instruct: Qwen2.5's template, ChatML that opens with
  # "You are a helpful assistant." when no system message is given.
  'dream': Template(
    turns={r: (f'<|im_start|>{r}\n', '<|im_end|>\n') for r in ('system', 'user', 'assistant')},
    generation='<|im_start|>assistant\n',
    default_system='You are a helpful assistant.',
  ),
}


def get_template(name: str) -> Template:
  if name not in TEMPLATES:
    raise DataError(
      f'unknown chat template {name!r}; known: {sorted(TEMPLATES)} '
      '(set --config.sft.chat_template).'
    )
  return TEMPLATES[name]


def check_messages(messages, template: Template, name: str = 'the template') -> None:
  """Raises DataError for a message that is not {role, content: str} or a role the template
  does not define."""
  if not isinstance(messages, (list, tuple)) or not messages:
    raise DataError(
      f'messages must be a non-empty list of {{"role", "content"}} objects, got '
      f'{type(messages).__name__}.'
    )
  for i, message in enumerate(messages):
    if (
      not isinstance(message, dict)
      or not isinstance(message.get('content'), str)
      or 'role' not in message
    ):
      raise DataError(f'message {i} is not {{"role": str, "content": str}}: {message!r:.100}')
    if message['role'] not in template.turns:
      raise DataError(
        f'message {i} has role {message["role"]!r}, which chat template {name} '
        f'does not define (its roles: {", ".join(template.turns)}); rename the '
        'role or pick another template.'
      )


def render_with(
  template: Template, messages, *, add_generation_prompt: bool = False, name: str = 'the template'
) -> str:
  """render() for a Template object (custom templates, tests)."""
  check_messages(messages, template, name)
  parts = [template.begin]
  for message in _with_default_system(template, messages):
    before, after = template.turns[message['role']]
    parts += [before, message['content'], after]
  if add_generation_prompt:
    parts.append(template.generation)
  return ''.join(parts)


def _with_default_system(template: Template, messages) -> list:
  if template.default_system and messages[0]['role'] != 'system':
    return [{'role': 'system', 'content': template.default_system}, *messages]
  return list(messages)


def render(template: str, messages, *, add_generation_prompt: bool = False) -> str:
  """The text of a conversation; add_generation_prompt opens an assistant reply after it."""
  return render_with(
    get_template(template),
    messages,
    add_generation_prompt=add_generation_prompt,
    name=repr(template),
  )


def checkpoint_template(config) -> str:
  """The template a checkpoint's prompts get: the one it was fine-tuned with (sft.chat_template),
  'none' (raw text) for a pre-trained one."""
  if not config_lib.stage_traits(config).chat_template:
    return 'none'
  return config.sft.chat_template


def prompt_text(template: str, user_text: str) -> str:
  """One user turn followed by the opening of the assistant's reply (what a sampler continues)."""
  return render(template, [{'role': 'user', 'content': user_text}], add_generation_prompt=True)


def split_conversation(template: str, messages) -> tuple[str, str]:
  """(prompt text, response text) for SFT: the last message is the response (an assistant turn);
  everything before it, with the generation prompt, is the prompt (LLaDA's multi-turn rule)."""
  chosen = get_template(template)
  check_messages(messages, chosen, repr(template))
  if messages[-1]['role'] != 'assistant':
    raise DataError(
      f'the last message has role {messages[-1]["role"]!r}; an SFT conversation '
      "ends with the assistant's response."
    )
  context = _with_default_system(chosen, messages)[:-1]
  prompt = (
    render_with(chosen, context, add_generation_prompt=True, name=repr(template))
    if context
    else chosen.begin + chosen.generation
  )
  return prompt, messages[-1]['content']
