"""MATH-style answers: the final answer of a solution, its normalised form, and equivalence.

Extraction follows Hendrycks MATH (the last \\boxed{...} or \\fbox{...}, braces matched) with the
fallbacks of the peers' scripts: d1's eval reads <answer>...</answer>, lm-eval's minerva_math
reads "The final answer is X". Normalisation is the facts of Hendrycks' strip_string (units,
\\text, degrees, dollars, percent, \\dfrac/\\tfrac, a/b, \\sqrt2, spacing, "x = 3" -> "3").
Two answers are equivalent when their normalised strings are equal, else when math-verify (a
maintained sympy-based checker, Hugging Face) proves them equal; see docs/evaluation.md.
"""

from __future__ import annotations

import functools
import re
import threading

CAS_TIMEOUT_S = 3  # per parse and per comparison (math-verify's signal alarm)
_BOX_COMMANDS = ('\\boxed', '\\fbox')
_FINAL_ANSWER_RE = re.compile(
  r'(?:final answer is|answer is)\s*[:\s]*(.+?)(?:\.\s*I hope it is correct|\.?\s*$)',
  re.IGNORECASE | re.DOTALL,
)
_ANSWER_TAG_RE = re.compile(r'<answer>(.*?)</answer>', re.DOTALL)
_UNIT_WORDS = (
  'degrees',
  'degree',
  'units',
  'unit',
  'cm',
  'meters',
  'inches',
  'feet',
  'dollars',
  'cents',
  'square',
  'sq',
  'hours',
  'minutes',
  'seconds',
)


def last_boxed(text: str) -> str | None:
  """The contents of the last \\boxed{...} / \\fbox{...} (nested braces), or None.

  '\\boxed 5' (a space, no braces) gives the token after it, as Hendrycks' remove_boxed."""
  start = max(text.rfind(command) for command in _BOX_COMMANDS)
  if start < 0:
    return None
  command = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
  rest = text[start + len(command) :]
  if rest.startswith(' '):
    token = rest[1:].split('$')[0].split()
    return token[0] if token else None
  if not rest.startswith('{'):
    return None
  depth = 0
  for i, char in enumerate(rest):
    depth += char == '{'
    depth -= char == '}'
    if depth == 0:
      return rest[1:i]
  return None  # unbalanced: the completion was cut off inside the box


def extract_answer(text: str) -> str | None:
  """The final answer of a completion: the last box, else <answer> tags, else 'answer is X'."""
  boxed = last_boxed(text)
  if boxed is not None and boxed.strip():
    return boxed.strip()
  tags = _ANSWER_TAG_RE.findall(text)
  if tags and tags[-1].strip():
    inner = last_boxed(tags[-1])
    return (inner if inner else tags[-1]).strip()
  match = _FINAL_ANSWER_RE.search(text)
  if match:
    answer = match.group(1).strip().strip('$').strip()
    return answer or None
  return None


def _fix_fracs(s: str) -> str:
  """\\frac12 -> \\frac{1}{2}, \\frac1{2} -> \\frac{1}{2}, \\frac{1}2 -> \\frac{1}{2}."""
  parts = s.split('\\frac')
  out = parts[0]
  for part in parts[1:]:
    out += '\\frac'
    if part.startswith('{') or len(part) < 2:
      if part.startswith('{'):
        close = _closing_brace(part)
        if close is not None and close + 1 < len(part) and part[close + 1] != '{':
          part = part[: close + 1] + '{' + part[close + 1] + '}' + part[close + 2 :]
      out += part
      continue
    a, b, tail = part[0], part[1], part[2:]
    if b == '{':
      out += '{' + a + '}' + b + tail
    else:
      out += '{' + a + '}{' + b + '}' + tail
  return out


def _closing_brace(s: str) -> int | None:
  depth = 0
  for i, char in enumerate(s):
    depth += char == '{'
    depth -= char == '}'
    if depth == 0:
      return i
  return None


def _fix_sqrt(s: str) -> str:
  """\\sqrt2 -> \\sqrt{2} (a bare token after \\sqrt)."""
  return re.sub(r'\\sqrt(?![{\[])\s*([0-9a-zA-Z])', r'\\sqrt{\1}', s)


def _fix_a_slash_b(s: str) -> str:
  """'3/4' -> \\frac{3}{4}, '\\sqrt{2}/2' -> \\frac{\\sqrt{2}}{2} (an integer or a root over an
  integer)."""
  match = re.fullmatch(r'(-?)(\d+|\\sqrt\{\d+\})/(\d+)', s)
  return f'{match[1]}\\frac{{{match[2]}}}{{{match[3]}}}' if match else s


def normalize(answer: str) -> str:
  """Hendrycks-style canonical string of a final answer (no CAS): equal strings, equal answers."""
  s = answer.strip().replace('\n', '').rstrip('.')
  s = s.replace('\\!', '').replace('\\,', '').replace('\\;', '').replace('\\ ', '')
  s = s.replace('\\\\', '\\')
  s = s.replace('tfrac', 'frac').replace('dfrac', 'frac')
  s = s.replace('\\left', '').replace('\\right', '')
  s = re.sub(r'\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|°', '', s)
  s = s.replace('\\$', '').replace('$', '')
  s = s.replace('\\%', '').replace('%', '')
  s = re.sub(r'\\(?:text|textbf|mbox|mathrm)\{\s*\(?([A-Za-z])\)?\s*\}', r'\1', s)  # \text{(A)}
  s = re.sub(r'\\(?:text|mbox|mathrm)\{[^{}]*\}\s*$', '', s).strip() or s  # trailing units
  s = re.sub(r'\\(?:text|textbf|mbox|mathrm)\{([^{}]*)\}', r'\1', s)
  words = '|'.join(_UNIT_WORDS)
  s = re.sub(rf'(?<=[\d}}])\s*(?:{words})(?:\^?\d)?\s*$', '', s)
  s = re.sub(r'^\(([A-Ea-e])\)$', r'\1', s)  # (A) -> A
  s = s.replace(' .', ' 0.').replace('{.', '{0.')
  if s.startswith('.'):
    s = '0' + s
  lhs = re.fullmatch(r'\s*[A-Za-z](?:_\{?\w+\}?)?\s*=\s*(.+)', s)  # "x = 3" -> "3"
  if lhs:
    s = lhs.group(1)
  s = _fix_sqrt(s)
  s = s.replace(' ', '')
  s = _fix_fracs(s)
  if s == '0.5':
    s = '\\frac{1}{2}'
  s = _fix_a_slash_b(s)
  s = re.sub(r'(?<=\d),(?=\d{3}(?!\d))', '', s) if re.fullmatch(r'-?[\d,]+(\.\d+)?', s) else s
  if re.fullmatch(r'-?\d+\.0+', s):
    s = s.split('.')[0]
  return s


@functools.cache
def _math_verify():
  """math-verify, warmed up once untimed (its first parse loads sympy and its LaTeX grammar,
  seconds on a busy machine, which must not count against the per-answer timeout)."""
  try:
    import math_verify  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None
  try:
    math_verify.verify(
      math_verify.parse('$\\frac{1}{2}$', parsing_timeout=None),
      math_verify.parse('$0.5$', parsing_timeout=None),
      timeout_seconds=None,
    )
  except Exception:  # pylint: disable=broad-except  # the warm-up's verdict does not matter
    pass
  return math_verify


def cas_available() -> bool:
  """Whether math-verify (pip install math-verify; in the eval extra) is importable."""
  return _math_verify() is not None


def cas_equal(a: str, b: str) -> bool:
  """math-verify's verdict on two LaTeX answers (False when it is missing, fails or times out).

  Its timeout is a SIGALRM, which only the main thread may set; elsewhere it runs untimed."""
  mv = _math_verify()
  if mv is None:
    return False
  timeout = CAS_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
  try:
    gold = mv.parse(f'${b}$', parsing_timeout=timeout)
    guess = mv.parse(f'${a}$', parsing_timeout=timeout)
    if not gold or not guess:
      return False
    return bool(mv.verify(gold, guess, timeout_seconds=timeout))
  except Exception:  # pylint: disable=broad-except  # the CAS's failure is "not shown equal"
    return False


def cas_verify_text(completion: str, gold: str) -> bool:
  """math-verify on a whole completion (it finds the answer itself) against a gold answer."""
  mv = _math_verify()
  if mv is None or len(completion) > 20000:
    return False
  timeout = CAS_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
  try:
    parsed_gold = mv.parse(f'${gold}$', parsing_timeout=timeout)
    parsed = mv.parse(completion, parsing_timeout=timeout)
    return bool(parsed_gold and parsed and mv.verify(parsed_gold, parsed, timeout_seconds=timeout))
  except Exception:  # pylint: disable=broad-except
    return False


def is_equiv(a: str | None, b: str | None) -> bool:
  """Whether two final answers are the same: normalised strings, else the CAS."""
  if a is None or b is None:
    return False
  if a.strip() == b.strip():
    return True
  na, nb = normalize(a), normalize(b)
  if na == nb:
    return True
  if len(a) > 400 or len(b) > 400:  # a runaway completion, not an answer
    return False
  return cas_equal(a, b) or cas_equal(na, nb)
