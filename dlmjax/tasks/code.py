"""Code tasks: HumanEval, MBPP and KodCode rows as sandboxed programs (dlmjax/tasks/code_exec.py).

Formats (one row each, jsonl / parquet / hub:NAME via dlmjax/data/records.py):
  humaneval  {"task_id", "prompt", "canonical_solution", "test", "entry_point"}: the prompt is
             the function's signature and docstring; each statement of check(candidate) that
             asserts is one test (evaluated with candidate = the entry point)
  mbpp       {"text" or "prompt", "code", "test_list", "test_setup_code"?}: lm-eval's MBPP
             prompt, zero-shot (the task, its tests, [BEGIN]); each test_list entry is one test
  kodcode    {"question", "solution", "test"}: the test is a pytest module that imports from
             `solution`; each top-level test_* function (and Test* class method) is one test,
             a @pytest.mark.parametrize one runs over all its cases as one test
  humaneval_infill  HumanEval-Infilling's rows (openai/human-eval-infilling: single-line,
             multi-line, random-span) {"task_id", "prompt" (the code before the hole), "suffix"
             (after it), "canonical_solution" (the hole's text), "test", "entry_point"}: the
             model fills the hole (evaluate tasks, dlmjax/diffusion/infill.py) and the program
             is prompt + middle + suffix, as the harness runs it; tests as humaneval's
The solution is the completion's last ```python fenced block when it has one, else the
completion itself; for humaneval a solution that does not define the entry point continues the
prompt (prompt + completion, as the original harness). Reward: the fraction of tests passed.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
import os
import re

from dlmjax.tasks import base
from dlmjax.tasks import code_exec

_FENCE_RE = re.compile(r'```(?:python|py|Python)?[ \t]*\n(.*?)```', re.DOTALL)
MBPP_PROMPT = (
  'You are an expert Python programmer, and here is your task: {text} '
  'Your code should pass these tests:\n\n{tests}\n[BEGIN]\n'
)


@dataclasses.dataclass(frozen=True)
class CodeExample(base.Example):
  """An Example with its tests; `answer` is the task id."""

  tests: tuple[str, ...] = ()
  setup: str = ''
  prefix: str = ''  # code a continuation completes (humaneval's prompt)
  entry_point: str = ''
  paths: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class InfillExample(CodeExample):
  """A CodeExample whose completion is the middle between `prefix` and `suffix`; `response` is
  the canonical middle."""

  suffix: str = ''


def extract_code(completion: str) -> str:
  """The last fenced code block of a completion, or the completion itself up to lm-eval MBPP's
  '[DONE]' stop string."""
  blocks = _FENCE_RE.findall(completion)
  return blocks[-1] if blocks else completion.split('[DONE]')[0]


def program_of(example: CodeExample, completion: str) -> code_exec.Program:
  if isinstance(example, InfillExample):  # the hole's text, as written: no fence to extract
    code = example.prefix + completion + example.suffix
    return code_exec.Program(code, example.tests, example.setup, example.paths)
  code = extract_code(completion)
  if example.prefix and not re.search(rf'def\s+{re.escape(example.entry_point)}\s*\(', code):
    code = example.prefix + code
  return code_exec.Program(code, example.tests, example.setup, example.paths)


def _has_assert(node: ast.AST) -> bool:
  return any(isinstance(n, ast.Assert) for n in ast.walk(node))


def humaneval_tests(test: str, entry_point: str) -> tuple[str, tuple[str, ...]]:
  """(setup, tests) of a HumanEval test: check()'s asserting statements are the tests; the rest
  of the module, `candidate = entry_point` and check()'s other statements are setup/glue."""
  module = ast.parse(test)
  checks = [n for n in module.body if isinstance(n, ast.FunctionDef) and n.name == 'check']
  if not checks:
    raise ValueError('the test defines no check(candidate)')
  preamble = [ast.get_source_segment(test, n) for n in module.body if n is not checks[0]]
  check = checks[0]
  argument = check.args.args[0].arg if check.args.args else 'candidate'
  setup, tests, glue = [*preamble, f'{argument} = {entry_point}'], [], []
  for statement in check.body:
    source = ast.get_source_segment(test, statement)
    if _has_assert(statement):
      tests.append('\n'.join([*glue, source]))
      glue = []
    elif tests:
      glue.append(source)
    else:
      setup.append(source)
  if glue and tests:
    tests[-1] += '\n' + '\n'.join(glue)
  if not tests:
    raise ValueError('check(candidate) asserts nothing')
  return '\n'.join(s for s in setup if s), tuple(tests)


def _parametrize_call(name: str, decorator: ast.AST, test: str) -> str | None:
  """'for args in VALUES: name(*args)' for @pytest.mark.parametrize('a,b', VALUES)."""
  if not (isinstance(decorator, ast.Call) and ast.unparse(decorator.func).endswith('parametrize')):
    return None
  names, values = decorator.args[:2] if len(decorator.args) >= 2 else (None, None)
  if not isinstance(names, ast.Constant) or values is None:
    return None
  count = len([n for n in str(names.value).split(',') if n.strip()])
  source = ast.get_source_segment(test, values)
  call = f'{name}(*__case)' if count > 1 else f'{name}(__case)'
  return f'for __case in {source}:\n  {call}'


def kodcode_tests(test: str) -> tuple[str, tuple[str, ...]]:
  """(setup, tests) of a pytest module: the module is setup; one call per test function."""
  module = ast.parse(test)
  tests = []
  for node in module.body:
    if isinstance(node, ast.FunctionDef) and node.name.startswith('test'):
      calls = [_parametrize_call(node.name, d, test) for d in node.decorator_list]
      tests.append(next((c for c in calls if c), f'{node.name}()'))
    elif isinstance(node, ast.ClassDef) and node.name.startswith('Test'):
      tests += [
        f'{node.name}().{m.name}()'
        for m in node.body
        if isinstance(m, ast.FunctionDef) and m.name.startswith('test')
      ]
  if not tests:
    raise ValueError('the test module defines no test_* function')
  return test, tuple(tests)


def _pytest_paths(test: str) -> tuple[str, ...]:
  """The directory holding pytest when a test module imports it (added to the child's path)."""
  if 'pytest' not in test:
    return ()
  spec = importlib.util.find_spec('pytest')
  if spec is None or not spec.origin:
    return ()
  return (os.path.dirname(os.path.dirname(spec.origin)),)


class CodeTask(base.FileTask):
  """Rows of one code format, scored by running them (reward = fraction of tests passed)."""

  max_reward = 1.0
  parallel = True  # rewards of a batch are scored together (judge), in parallel sandboxes

  def __init__(self, *args, limits: code_exec.Limits = code_exec.Limits(), **kwargs):
    super().__init__(*args, **kwargs)
    self.limits = limits
    # Run programs where the machine has no OS boundary (code_exec.require_boundary): the
    # callers' opt-in, rl.allow_unsandboxed_code or evaluate's --allow-unsandboxed-code.
    self.allow_unsandboxed = False
    self._scorer = None

  def sandbox(self) -> str:
    """The start-up line saying what holds the programs; raises SandboxUnavailable (before any
    program runs) where nothing does and the caller has not opted in."""
    return code_exec.require_boundary(self.allow_unsandboxed)

  @property
  def scorer(self) -> code_exec.Scorer:
    if self._scorer is None:
      self._scorer = code_exec.Scorer(self.limits, allow_unsandboxed=self.allow_unsandboxed)
    return self._scorer

  def outcomes(self, examples, completions) -> list[code_exec.Outcome]:
    return self.scorer.run([program_of(e, c) for e, c in zip(examples, completions)])

  def judge(self, examples, completions):
    rewards, correct, _ = self.judge_counted(examples, completions)
    return rewards, correct

  def judge_counted(self, examples, completions):
    """(rewards, correct, the share of each verdict: code_exec.verdict_fractions)."""
    outcomes = self.outcomes(examples, completions)
    rewards = [o.reward for o in outcomes]
    return rewards, [r >= 1.0 for r in rewards], code_exec.verdict_fractions(outcomes)

  def score(self, example, completion):
    return self.outcomes([example], [completion])[0].reward


class HumanEval(CodeTask):
  name = 'humaneval'
  row_help = '"prompt", "test" (with check(candidate)) and "entry_point"'

  def example_of(self, row):
    prompt, entry = row['prompt'], row['entry_point']
    setup, tests = humaneval_tests(row['test'], entry)
    return CodeExample(
      prompt=prompt,
      response=row.get('canonical_solution') or '',
      answer=str(row.get('task_id', entry)),
      tests=tests,
      setup=setup,
      prefix=prompt,
      entry_point=entry,
    )


class Mbpp(CodeTask):
  name = 'mbpp'
  row_help = '"text" (or "prompt"), "code" and "test_list"'

  def example_of(self, row):
    tests = row['test_list']
    if isinstance(tests, str):
      tests = json.loads(tests)
    if not tests or not all(isinstance(t, str) for t in tests):
      raise ValueError('"test_list" must be a non-empty list of assert strings')
    text = row.get('text') or row['prompt']
    return CodeExample(
      prompt=MBPP_PROMPT.format(text=text, tests='\n'.join(tests)),
      response=f'```python\n{row.get("code", "")}\n```',
      answer=str(row.get('task_id', '')),
      tests=tuple(tests),
      setup=row.get('test_setup_code') or '',
    )


class KodCode(CodeTask):
  name = 'kodcode'
  row_help = '"question", "solution" and "test" (a pytest module importing from solution)'

  def example_of(self, row):
    setup, tests = kodcode_tests(row['test'])
    return CodeExample(
      prompt=row['question'],
      response=f'```python\n{row.get("solution", "")}\n```',
      answer=str(row.get('question_id', row.get('conversation_id', ''))),
      tests=tests,
      setup=setup,
      paths=_pytest_paths(row['test']),
    )


class HumanEvalInfill(CodeTask):
  """HumanEval-Infilling: a hole in a HumanEval function, filled by infilling (evaluation only:
  RL samples completions after a prompt, not middles)."""

  name = 'humaneval_infill'
  infill = True  # evaluate tasks fills example.prefix <hole> example.suffix
  row_help = (
    '"prompt", "suffix", "canonical_solution", "test" (with check(candidate)), "entry_point"'
  )

  def example_of(self, row):
    prompt, suffix, entry = row['prompt'], row['suffix'], row['entry_point']
    if not all(isinstance(x, str) for x in (prompt, suffix, row['canonical_solution'])):
      raise TypeError('"prompt", "suffix" and "canonical_solution" must be strings')
    setup, tests = humaneval_tests(row['test'], entry)
    return InfillExample(
      prompt=prompt,
      response=row['canonical_solution'],
      answer=str(row.get('task_id', entry)),
      tests=tests,
      setup=setup,
      prefix=prompt,
      entry_point=entry,
      suffix=suffix,
    )
