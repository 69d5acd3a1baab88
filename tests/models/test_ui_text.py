"""The Temporal UI's markdown: prices keep their `$`, lists get their blank line, identifiers stay literal."""

from __future__ import annotations

import pytest

from models.ui_text import SUMMARY_LIMIT
from models.ui_text import Details
from models.ui_text import code
from models.ui_text import md
from models.ui_text import md_usd
from models.ui_text import summary
from models.ui_text import usd


def test_dollar_signs_are_escaped_so_a_pair_is_not_a_math_span() -> None:
    assert md("compute $0.90 + transfer $0.01") == r"compute \$0.90 + transfer \$0.01"
    assert md_usd(0.95, "GPU-h") == r"\$0.95/GPU-h"
    assert usd(1234.5) == "$1,234.50"


@pytest.mark.parametrize("char", list("\\`*_[]{}<>#|~$!"))
def test_every_character_markdown_reads_as_syntax_is_escaped(char: str) -> None:
    assert md(f"a{char}b") == f"a\\{char}b"


def test_plain_words_are_unchanged() -> None:
    assert md("sim/eu-west (3 pods), 1.5 GPU-h") == "sim/eu-west (3 pods), 1.5 GPU-h"


def test_a_list_is_its_own_block_after_a_blank_line() -> None:
    text = Details().para("**Plan** p-1").bullets(["one", "two"]).para("after").render()
    assert text == "**Plan** p-1\n\n- one\n- two\n\nafter"


def test_a_long_list_says_how_many_were_left_out() -> None:
    text = Details().bullets([str(i) for i in range(25)], limit=20, more="pods").render()
    assert text.splitlines()[-1] == "- … 5 pods" and len(text.splitlines()) == 21


def test_empty_parts_leave_no_empty_blocks() -> None:
    assert Details().para("").bullets([]).para("x").render() == "x"


def test_code_spans_hold_backticks_literally() -> None:
    assert code("op-1") == "`op-1`"
    assert code("a`b") == "``a`b``"
    assert code("`x") == "`` `x ``"


def test_a_summary_is_cut_to_temporal_limit_on_a_character_boundary() -> None:
    assert summary("short") == "short"
    cut = summary("€" * 300)  # 3 bytes each
    assert len(cut.encode()) <= SUMMARY_LIMIT and cut.endswith("...") and "\ufffd" not in cut
