"""Exact reading of answers that are just a number: :func:`plain_number`.

A *plain number* is an integer (``42``, ``-7``, ``1,234``, ``1{,}234``), a decimal (``0.25``, ``.5``,
``1,234.5``), a fraction of integers (``3/4``, ``\\frac{3}{4}``, ``\\dfrac``, ``\\tfrac``), with an optional
leading sign (``+``, ``-`` or U+2212 ``−``), optionally inside a single ``\\boxed{…}``, and all of that
optionally inside ``$…$`` or ``\\(…\\)`` on one line. Anything more (units, percent, variables, equations,
intervals, several numbers, exponents, words) is not a plain number.

Values are :class:`fractions.Fraction`, so ``0.1 + 0.2`` really is ``3/10`` and a 40-digit integer keeps
every digit.
"""

from __future__ import annotations

import re
from fractions import Fraction

__all__ = ["plain_number"]

# [0-9], not \d: \d also matches other scripts' digits, which int() reads but a math grader may not.
_THOUSANDS = r"[1-9][0-9]{0,2}(?P<sep>,|\{,\})[0-9]{3}(?:(?P=sep)[0-9]{3})*"
_NUMBER = re.compile(
    rf"""
    (?P<sign>[-+\u2212]?)
    (?:
        \\[dt]?frac\{{(?P<frac_num>-?[0-9]+)\}}\{{(?P<frac_den>-?[0-9]+)\}}
      | (?P<num>[0-9]+)/(?P<den>[0-9]+)
      | (?P<int>{_THOUSANDS}|[0-9]+)(?:\.(?P<decimals>[0-9]+))?
      | \.(?P<only_decimals>[0-9]+)
    )
    """,
    re.VERBOSE,
)
# A "$" inside would make this two formulas ("$1$ or $2$"), not one. A line break inside is refused because
# math_verify reads inline math only on one line, and the math grader's fast path must read what it reads.
_MATH_DELIMITERS = re.compile(r"\$(?P<dollar>[^$\n]*)\$|\\\((?P<paren>[^\n]*)\\\)")
_BOXED = re.compile(r"\\boxed\{(?P<inner>.*)\}", re.DOTALL)


def _unwrap(pattern: re.Pattern[str], text: str) -> str:
    m = pattern.fullmatch(text)
    if m is None:
        return text
    return next(group for group in m.groups() if group is not None).strip()


def _value(m: re.Match[str]) -> Fraction | None:
    if m["frac_num"] is not None:
        num, den = int(m["frac_num"]), int(m["frac_den"])
    elif m["num"] is not None:
        num, den = int(m["num"]), int(m["den"])
    elif m["int"] is not None:
        decimals = m["decimals"] or ""
        num, den = int(m["int"].replace("{,}", "").replace(",", "") + decimals), 10 ** len(decimals)
    else:
        decimals = m["only_decimals"]
        num, den = int(decimals), 10 ** len(decimals)
    if den == 0:
        return None
    value = Fraction(num, den)
    return -value if m["sign"] in ("-", "\u2212") else value


def plain_number(text: str) -> Fraction | None:
    """The exact value of ``text`` if it is a plain number (see the module docstring), else ``None``."""
    inner = _unwrap(_BOXED, _unwrap(_MATH_DELIMITERS, text.strip()))
    m = _NUMBER.fullmatch(inner)
    if m is None:
        return None
    try:
        return _value(m)
    except ValueError:  # over sys.get_int_max_str_digits() digits: too long to be worth reading here
        return None
