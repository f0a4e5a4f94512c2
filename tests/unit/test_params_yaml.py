"""params.yaml's comments say what a setting does and name the table or page behind a choice
(metrics/sweeps/..., docs/results/...); they never quote a measured figure, which goes stale
with the next run while the table keeps it. A decimal or a percentage in a comment is taken for
such a figure: the values themselves (lr: 0.002) are not comments and may be anything."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIGURE = re.compile(r"\d+\.\d+|\d\s*%")
QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"")  # a '#' inside a quoted value is not a comment


def figures_in_comments(text: str) -> list[str]:
    """'line N: comment' for each comment that carries a decimal figure or a percentage."""
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        code = QUOTED.sub(lambda m: " " * len(m.group(0)), line)
        at = code.find("#")
        if at >= 0 and FIGURE.search(comment := line[at + 1 :].strip()):
            found.append(f"line {n}: {comment}")
    return found


def test_params_comments_quote_no_figures():
    assert figures_in_comments((ROOT / "params.yaml").read_text()) == []


def test_the_check_catches_a_figure_in_a_comment_and_nothing_else():
    text = (
        "train:\n"
        "  lr: 0.002                  # the published rate (metrics/sweeps/full-recipe.csv)\n"
        "  decode_rows: 64            # 64 pays over 32: 1.3x\n"
        "  # warmup 4% beat 1%\n"
        "  name: 'run #2.5'           # a quoted '#' is a value\n"
        "  epochs: 4                  # no sweep judged it\n"
    )
    assert figures_in_comments(text) == [
        "line 3: 64 pays over 32: 1.3x",
        "line 4: warmup 4% beat 1%",
    ]
