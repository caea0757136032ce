"""What every verifiable task shares: the Example record, the split rule and answer extraction.

Tasks are generated offline and deterministically; a problem's split is a pure function of its
solution, so no test answer can appear in training (SPG's leak-free split, dlm_peers.md 5).
"""

from __future__ import annotations

import dataclasses
import hashlib
import re

from dlmjax.data import records

SPLITS = ('train', 'test')
TEST_FRACTION = 0.2  # share of solutions held out for the test split

_ANSWER_RE = re.compile(r'<answer>(.*?)</answer>', re.DOTALL)


@dataclasses.dataclass(frozen=True)
class Example:
  prompt: str
  response: str  # a short worked solution ending in the answer, in the format `reward` parses.
  answer: str


def split_of(solution_key: str) -> str:
  """'test' for a stable TEST_FRACTION of solution keys, 'train' otherwise (stable across runs)."""
  digest = hashlib.sha256(solution_key.encode()).digest()
  return 'test' if int.from_bytes(digest[:8], 'big') / 2**64 < TEST_FRACTION else 'train'


def check_request(name: str, split: str, num: int) -> None:
  if split not in SPLITS:
    raise ValueError(f'{name}: split={split!r} is not one of {SPLITS}.')
  if num < 0:
    raise ValueError(f'{name}: num={num} must be >= 0.')


def last_answer(completion: str) -> str | None:
  """The text inside the last <answer>...</answer>, or None (d1's countdown/sudoku parsers)."""
  matches = _ANSWER_RE.findall(completion)
  return matches[-1] if matches else None


def collect(name: str, split: str, num: int, seed: int, draw, *, max_misses: int = 5000):
  """`num` distinct examples of `split`; draw(rng) -> (problem key, solution key, Example).

  Problems are deduplicated by problem key; the split follows the solution key. Stops with a
  clear error after max_misses draws in a row that add nothing (the split is exhausted)."""
  import random  # pylint: disable=import-outside-toplevel

  check_request(name, split, num)
  rng = random.Random(f'{name}:{split}:{seed}')
  seen, out, misses = set(), [], 0
  while len(out) < num and misses < max_misses:
    key, solution_key, example = draw(rng)
    if key in seen or split_of(f'{name}:{solution_key}') != split:
      misses += 1
      continue
    seen.add(key)
    out.append(example)
    misses = 0
  if len(out) < num:
    raise ValueError(
      f'{name}: only about {len(out)} distinct {split} examples exist (asked for '
      f'{num}); ask for fewer.'
    )
  return out


class Task:
  """A verifiable task: deterministic examples per split and an exact reward that never raises."""

  name = ''
  max_reward = 1.0  # the reward of a correct, well-formatted completion

  def examples(self, split: str, num: int, seed: int) -> list[Example]:
    raise NotImplementedError

  def score(self, example: Example, completion: str) -> float:
    """The reward; may raise on garbage (reward() turns that into 0)."""
    raise NotImplementedError

  def near_miss(self, example: Example, rng) -> str:
    """The example's worked solution with a plausible wrong final answer (the judge calls it
    wrong): the rejected side of the hard preference pairs (preference_rows.PAIR_KINDS)."""
    raise ValueError(
      f'task {self.name} has no near-miss responses; use the pairs of another problem (other) '
      'or a task that has them (arithmetic, countdown3/4, sudoku4).'
    )

  def is_correct(self, example: Example, completion: str) -> bool:
    """Whether the completion solves the problem (held-out accuracy)."""
    return self.reward(example, completion) >= self.max_reward - 1e-9

  def judge(self, examples, completions) -> tuple[list[float], list[bool]]:
    """(rewards, correct) of a batch; tasks that run code score it in parallel."""
    rewards = [self.reward(e, c) for e, c in zip(examples, completions)]
    return rewards, [self.safe_is_correct(e, c) for e, c in zip(examples, completions)]

  def metrics(self, examples, completions) -> dict[str, list[float]]:
    """Per completion: accuracy, reward and the peers' own metrics (docs/evaluation.md)."""
    rewards, correct = self.judge(examples, completions)
    extra = self.peer_metrics(examples, completions)
    return {'accuracy': [float(c) for c in correct], 'mean_reward': list(rewards), **extra}

  def peer_metrics(self, examples, completions) -> dict[str, list[float]]:
    """The peers' scripts' metrics, where they extract differently from `is_correct`."""
    del examples, completions
    return {}

  def safe_is_correct(self, example: Example, completion: str) -> bool:
    try:
      return bool(self.is_correct(example, completion))
    except Exception:  # pylint: disable=broad-except  # garbage in -> not correct, never a crash
      return False

  def reward(self, example: Example, completion: str) -> float:
    try:
      value = float(self.score(example, completion))
    except Exception:  # pylint: disable=broad-except  # garbage in -> no reward, never a crash
      return 0.0
    return value if value == value and abs(value) != float('inf') else 0.0


class FileTask(Task):
  """A task whose problems come from a data source per split (dlmjax/data/records.py).

  Subclasses turn one row into an Example (`example_of`, raising KeyError/TypeError/ValueError
  on a bad row); the split's rows are shuffled by the seed and the first `num` (0: all)
  returned."""

  row_help = ''  # what a row holds, for error messages

  def __init__(self, train_path: str, test_path: str = '', *, columns: str = ''):
    self.paths = {'train': train_path, 'test': test_path}
    self.columns = columns

  def example_of(self, row: dict) -> Example:
    raise NotImplementedError

  def load(self, source: str) -> list[Example]:
    if not records.exists(source):
      raise FileNotFoundError(
        f'{self.name}: data {source!r} does not exist; pass a jsonl/parquet file or '
        f'hub:NAME with {self.row_help}.'
      )
    examples = []
    for where, row in records.read_records(source, columns=self.columns):
      try:
        examples.append(self.example_of(row))
      except (KeyError, TypeError, ValueError) as e:
        raise ValueError(
          f'{where}: not a {self.name} row ({type(e).__name__}: {e}); each row needs '
          f'{self.row_help} (rename columns with --config.data.columns).'
        ) from e
    if not examples:
      raise ValueError(f'{source} holds no examples.')
    return examples

  def examples(self, split, num, seed):
    import random  # pylint: disable=import-outside-toplevel

    check_request(self.name, split, num)
    if not self.paths[split]:
      raise ValueError(f'{self.name}: no data for the {split} split.')
    rows = self.load(self.paths[split])
    random.Random(seed).shuffle(rows)
    num = num or len(rows)  # 0: every row (evaluation)
    if num > len(rows):
      raise ValueError(
        f'{self.name}: {self.paths[split]} has {len(rows)} examples, asked for {num}.'
      )
    return rows[:num]
