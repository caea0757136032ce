"""Chat templates render exactly the documented text; bad conversations fail clearly."""

import pytest

from dlmjax.data import chat
from dlmjax.data.errors import DataError

CONVERSATION = [
  {'role': 'system', 'content': 'Be brief.'},
  {'role': 'user', 'content': 'Hi?'},
  {'role': 'assistant', 'content': 'Hello.'},
  {'role': 'user', 'content': '2+2?'},
]


def test_templates_render_the_documented_text():
  assert chat.render('none', CONVERSATION) == 'Be brief.Hi?Hello.2+2?'
  assert chat.render('plain', CONVERSATION, add_generation_prompt=True) == (
    'System: Be brief.\nUser: Hi?\nAssistant: Hello.\nUser: 2+2?\nAssistant: '
  )
  assert chat.render('chatml', CONVERSATION[1:3]) == (
    '<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n'
  )
  # LLaDA-8B-Instruct's template (Llama-3 headers after its BOS).
  assert chat.prompt_text('llada', 'Hi?') == (
    '<|startoftext|><|start_header_id|>user<|end_header_id|>\n\nHi?<|eot_id|>'
    '<|start_header_id|>assistant<|end_header_id|>\n\n'
  )
  assert set(chat.TEMPLATES) >= {'none', 'plain', 'llada', 'chatml'}


def test_dream_template_is_qwen2p5_chatml_with_its_default_system_turn():
  """Dream-v0-Instruct's template (Qwen2.5's): ChatML, opening with "You are a helpful
  assistant." when the conversation has no system message, and with the given one otherwise;
  SFT's prompt (split_conversation) and generate's (prompt_text) both carry it."""
  default = '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n'
  assert chat.prompt_text('dream', 'Hi?') == (
    default + '<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\n'
  )
  assert chat.render('dream', CONVERSATION[:2]) == (
    '<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi?<|im_end|>\n'
  )
  prompt, response = chat.split_conversation('dream', CONVERSATION[1:3])
  assert (prompt, response) == (chat.prompt_text('dream', 'Hi?'), 'Hello.')


def test_prompt_text_is_render_of_one_user_turn():
  for name in chat.TEMPLATES:
    assert chat.prompt_text(name, 'x') == chat.render(
      name, [{'role': 'user', 'content': 'x'}], add_generation_prompt=True
    )


def test_split_conversation_takes_the_last_assistant_turn_as_the_response():
  messages = CONVERSATION + [{'role': 'assistant', 'content': '4'}]
  prompt, response = chat.split_conversation('plain', messages)
  assert response == '4'
  assert prompt == chat.render('plain', CONVERSATION, add_generation_prompt=True)
  # The prompt followed by the response is the whole conversation up to the final turn's end.
  assert chat.render('plain', messages).startswith(prompt + response)
  with pytest.raises(DataError, match='ends with the assistant'):
    chat.split_conversation('plain', CONVERSATION)


@pytest.mark.parametrize(
  'messages,message',
  [
    ([{'role': 'tool', 'content': 'x'}], "role 'tool'"),
    ([{'role': 'user'}], 'not {"role": str, "content": str}'),
    ([], 'non-empty list'),
  ],
)
def test_bad_messages_fail_clearly(messages, message):
  with pytest.raises(DataError, match=message):
    chat.render('plain', messages)


def test_a_template_missing_a_role_names_it():
  no_system = chat.Template(
    turns={'user': ('U: ', '\n'), 'assistant': ('A: ', '\n')}, generation='A: '
  )
  with pytest.raises(DataError, match="role 'system'.*its roles: user, assistant"):
    chat.render_with(no_system, CONVERSATION, name='no_system')
  with pytest.raises(DataError, match="unknown chat template 'alpaca'"):
    chat.render('alpaca', CONVERSATION)
