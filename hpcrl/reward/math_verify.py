"""Math answer verification: pull the final answer out of a model response and
compare it with a reference answer exactly.

Pipeline for one response (``math_reward``):

1. ``extract_answer`` picks the final answer, by priority: the last
   ``\\boxed{...}`` (nested braces handled), else the last "The answer is X" /
   "answer: X" (case-insensitive), else the last "#### X" (GSM8K style), else
   the last number anywhere in the text.
2. ``answers_match`` compares it with the reference: as exact rationals
   (``fractions.Fraction``, so ``0.5 == 1/2 == \\frac{1}{2}``) when both sides
   parse as numbers, else as normalised strings (no ``$``, spaces, ``\\left``,
   ``\\text{}`` wrappers; case-insensitive).

Everything here is a pure function of its arguments: no state, no I/O, only
the standard library, so it is cheap to import in a reward worker process.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_IS = re.compile(r"\bthe\s+(?:final\s+)?answer\s+is\b\s*:?|\banswer\s*:", re.IGNORECASE)
_HASHES = re.compile(r"####")
# A number as it appears in running text: optional sign (not a binary minus
# such as the one in "10-3"), digit groups with thousands commas, decimals,
# a plain fraction, or a LaTeX \frac{a}{b}.
_NUMBER_IN_TEXT = re.compile(
    r"-?\\[dt]?frac\{[^{}]*\}\{[^{}]*\}"
    r"|(?<![\w.)\]}])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?"
    r"|(?<=[\w)\]}])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?"
)
_PLAIN_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?(?:/\d+)?")
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d*)?")
_FRAC = re.compile(r"([+-]?)\\[dt]?frac\s*\{\s*([^{}]+?)\s*\}\s*\{\s*([^{}]+?)\s*\}")
_FRAC_SHORT = re.compile(r"([+-]?)\\[dt]?frac\s*(\d)(\d)")
_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]*)\}")


def _boxed_contents(text: str) -> list[str]:
    """Contents of every ``\\boxed{...}`` in order, matching nested braces."""
    found = []
    for match in _BOXED.finditer(text):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    found.append(text[start:i])
                    break
    return found


def _clip_sentence(candidate: str) -> str:
    """'42. Let me check' -> '42': cut at the first sentence end."""
    return re.split(r"\.(?=\s|$)", candidate.strip(), maxsplit=1)[0].strip()


def extract_answer(text: str) -> str | None:
    """Final answer of a model response, by priority: last \\boxed{...} (nested
    braces handled), 'The answer is X' / 'answer: X' (case-insensitive, last
    occurrence), '#### X', else the last number in the text. None if nothing."""
    if not text:
        return None
    boxed = _boxed_contents(text)
    if boxed:
        return boxed[-1].strip()
    for marker in (_ANSWER_IS, _HASHES):
        # what follows each marker up to the line's end, clipped at a sentence end
        found = [_clip_sentence(text[m.end() :].split("\n", 1)[0]) for m in marker.finditer(text)]
        found = [f for f in found if f]
        if found:
            return found[-1]
    numbers = _NUMBER_IN_TEXT.findall(text)
    return numbers[-1] if numbers else None


def _strip_wrappers(text: str) -> str:
    """Remove math-mode and formatting wrappers that do not change a value."""
    text = text.strip().replace("\u2212", "-").replace("{,}", ",")
    for token in ("\\$", "$", "\\left", "\\right", "\\!", "\\,", "\\;", "\\ "):
        text = text.replace(token, "")
    text = _TEXT_WRAPPER.sub(r"\1", text).strip()
    if text.startswith("\\boxed"):
        inner = _boxed_contents(text)
        if inner:
            text = inner[-1].strip()
    return text.rstrip(".").strip()


def parse_number(text: str) -> Fraction | None:
    """'59', '-3', '1,234', '3.50', '3/4', '\\frac{3}{4}', '\\dfrac{3}{4}', '$5$',
    '5.' -> exact Fraction; None if not a number. A trailing percent sign is
    dropped ('50\\%' -> 50), so both sides of a comparison read it alike."""
    if not isinstance(text, str):
        return None
    text = _strip_wrappers(text)
    text = re.sub(r"\\?%$", "", text).strip()
    text = re.sub(r"\s+", "", text)
    frac = _FRAC.fullmatch(text) or _FRAC_SHORT.fullmatch(text)
    if frac:
        num, den = parse_number(frac.group(2)), parse_number(frac.group(3))
        if num is None or den is None or den == 0:
            return None
        value = num / den
        return -value if frac.group(1) == "-" else value
    if _THOUSANDS.fullmatch(text):
        text = text.replace(",", "")
    if not _PLAIN_NUMBER.fullmatch(text):
        return None
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def _normalise(text: str) -> str:
    text = _strip_wrappers(text)
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return re.sub(r"\s+", "", text).lower()


def answers_match(predicted: str | None, reference: str) -> bool:
    """Numeric comparison when both parse, else normalised string equality.

    A numeric reference also matches a prediction that contains exactly one
    number equal to it ('x = 5', '5 apples' against '5')."""
    if predicted is None or reference is None:
        return False
    predicted, reference = str(predicted), str(reference)
    pred_num, ref_num = parse_number(predicted), parse_number(reference)
    if pred_num is not None and ref_num is not None:
        return pred_num == ref_num
    if ref_num is not None:
        # 'x = 5' or '5 apples' against '5': a prediction holding exactly one
        # number is read as that number (two numbers stay ambiguous).
        numbers = _NUMBER_IN_TEXT.findall(_strip_wrappers(predicted))
        return len(numbers) == 1 and parse_number(numbers[0]) == ref_num
    pred_norm = _normalise(predicted)
    return bool(pred_norm) and pred_norm == _normalise(reference)


def reference_answer(answer: Any) -> str:
    """The final answer of a dataset reference: a GSM8K solution ('... #### 72')
    gives '72'; anything else is used as it is."""
    text = str(answer)
    if "####" in text:
        return text.rsplit("####", 1)[1].strip()
    return text.strip()


def math_reward(prompt: str, response: str, answer: str, **row: Any) -> float:
    """1.0 if the response's final answer matches ``answer``, else 0.0."""
    return 1.0 if answers_match(extract_answer(response), reference_answer(answer)) else 0.0
