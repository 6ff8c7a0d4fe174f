"""Math answer checking: extract the final number of a completion and compare exactly."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# Text after any of these is not part of the answer.
STOP_MARKERS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<eos>", "</s>", "<|end|>")

_NUMBER = re.compile(r"(?<![\w.)])-?\d[\d,]*(?:\.\d+)?|(?<![\w)])-?\.\d+")
_BOXED = re.compile(r"\\boxed\s*\{")
_HASHES = re.compile(r"####\s*(.*)")


def cut_at_stop(text: str) -> str:
    for m in STOP_MARKERS:
        i = text.find(m)
        if i >= 0:
            text = text[:i]
    return text


def _boxed_contents(text: str) -> str | None:
    """Contents of the last ``\\boxed{...}`` (braces balanced), or None."""
    last = None
    for m in _BOXED.finditer(text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            last = text[m.end() : i - 1]
    return last


def to_decimal(s: str) -> Decimal | None:
    s = s.replace(",", "").strip()
    try:
        return Decimal(s)
    except InvalidOperation:
        return None


def extract_final_number(text: str) -> str | None:
    """The final answer of a completion: the last number in the last ``\\boxed{...}``, else
    the number right after the last ``####``, else the last number in the text.

    Text after an end-of-sequence marker is ignored; thousands separators are removed.
    """
    text = cut_at_stop(text)
    boxed = _boxed_contents(text)
    nums = _NUMBER.findall(boxed) if boxed is not None else []
    if nums:
        return nums[-1].replace(",", "")
    hashes = _after_hashes(text)  # the number right after the last "####"
    nums = _NUMBER.findall(hashes) if hashes is not None else []
    if nums:
        return nums[0].replace(",", "")
    nums = _NUMBER.findall(text)
    return nums[-1].replace(",", "") if nums else None


def _after_hashes(text: str) -> str | None:
    matches = list(_HASHES.finditer(text))
    return matches[-1].group(1) if matches else None


def normalize_answer(answer: str) -> str:
    """The reference answer as a plain number string (``"#### 1,234"`` -> ``"1234"``).

    An answer with no number in it is returned stripped.
    """
    answer = str(answer)
    if "####" in answer:
        answer = answer.rsplit("####", 1)[1]
    boxed = _boxed_contents(answer)
    if boxed is not None:
        answer = boxed
    nums = _NUMBER.findall(answer)
    if len(nums) == 1 or (nums and answer.strip().replace(",", "") == nums[-1].replace(",", "")):
        return nums[-1].replace(",", "")
    return answer.strip()


def check_answer(completion: str, answer: str) -> float:
    """1.0 if the completion's final number equals the reference answer, else 0.0.

    Numbers compare by value (``"42.0"`` equals ``"42"``; ``"1,000"`` equals ``"1000"``).
    A reference without a number is compared as a stripped string with the text before
    any end-of-sequence marker.
    """
    ref = normalize_answer(answer)
    ref_num = to_decimal(ref)
    if ref_num is None:
        return 1.0 if cut_at_stop(completion).strip() == ref else 0.0
    got = extract_final_number(completion)
    if got is None:
        return 0.0
    got_num = to_decimal(got)
    return 1.0 if got_num is not None and got_num == ref_num else 0.0
