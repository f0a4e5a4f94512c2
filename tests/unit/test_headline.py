"""dspark.headline's table: a row per figure, a column per method, narrow enough that
`dvc metrics show -R metrics/headline metrics/full/headline` fits a 100-column terminal."""

import json

from dspark.config import methods
from dspark.headline import (
    DATA_COLUMN,
    HEADLINE_DIR,
    TABLE_ROWS,
    read_table,
    summary,
    table,
    write_table,
)
from tests.conftest import dvc_metrics_show

TERMINAL = 100
DOCS = {
    "eval": {
        "mean": {"dspark": 1.35871, "eagle3": 1.9198, "ngram": 1.7421, "none": 1.0},
        "pairs": {
            "dspark/eagle3": {"ratio": 0.70771, "ci95": [0.685, 0.7293]},
            "dspark/ngram": {"ratio": 0.7799, "ci95": [0.73, 0.81]},
            "eagle3/ngram": {"ratio": 1.102, "ci95": [1.06, 1.13]},
        },
    },
    "bench": {
        "overall": {
            "none": {"speedup_c1": 1.0},
            "none_vllm": {"speedup_c1": 1.4},
            "llamacpp": {"speedup_c1": 1.6},  # the peer: no column
            "llamacpp_lookup": {"speedup_c1": 1.9},
            "ngram": {"speedup_c1": 0.975},
            "dspark_fixed": {"speedup_c1": 0.831},
            "dspark_adaptive": {"speedup_c1": 0.9752},
            "eagle3": {"speedup_c2": 0.9},  # no single-stream figure: no cell
        }
    },
    "train": {
        "dspark": {"tau_decode": 1.6472, "tokens_per_s": 2076.4},
        "eagle3": {"tau_decode": 3.0857, "tokens_per_s": 1462.7},
        "goal": {"met": False},
    },
    "extract": {"tok_s": 323.6},
}


def test_a_row_per_figure_and_a_column_per_method():
    assert table(DOCS) == {
        "tau": {"dspark": 1.359, "eagle3": 1.92, "ngram": 1.742},
        "dspark_over": {"eagle3": 0.708, "ngram": 0.78},
        "speedup": {"ngram": 0.975, "dspark": 0.975},  # DSpark's best mode; `none`'s are 1
        "tau_decode": {"dspark": 1.647, "eagle3": 3.086},
        "train_tok_s": {"dspark": 2076, "eagle3": 1463},
        "data_tok_s": {DATA_COLUMN: 324},
    }
    assert table({}) == {}


def test_the_peers_modes_are_named_as_the_benchmark_names_them():
    from dspark.headline import PEER_MODES
    from dspark.serve.llamacpp_mode import MODES

    assert PEER_MODES == MODES


def test_the_table_is_written_a_file_a_row_and_a_missing_row_loses_its_file(tmp_path):
    assert write_table(tmp_path, DOCS) == table(DOCS)
    folder = tmp_path / HEADLINE_DIR
    assert sorted(p.stem for p in folder.iterdir()) == sorted(TABLE_ROWS)
    assert json.loads((folder / "tau.json").read_text()) == table(DOCS)["tau"]
    (folder / "notes.txt").write_text("not a row")
    without_extract = {k: v for k, v in DOCS.items() if k != "extract"}
    write_table(tmp_path, without_extract)  # a run whose extract file is another profile's
    assert not (folder / "data_tok_s.json").exists()
    assert (folder / "notes.txt").exists() and (folder / "tau.json").exists()


def widest(prefix: str, columns: list[str]) -> dict[str, dict]:
    """Every row with every column at its widest plausible figure (a GPU's 5-digit tok/s)."""
    folder = f"{prefix}/{HEADLINE_DIR}"
    return {f"{folder}/{row}.json": dict.fromkeys(columns, 12345) for row in TABLE_ROWS}


def test_the_widest_table_fits_a_terminal():
    """Every method the config knows, beside the committed full run's folder (the longer
    path), as `dvc metrics show` prints them."""
    columns = [m for m in methods() if m != "none"] + [DATA_COLUMN]
    files = {**widest("metrics", columns), **widest("metrics/full", columns)}
    lines = dvc_metrics_show(files)
    assert len(lines) == 1 + 2 * len(TABLE_ROWS)
    assert max(map(len, lines)) <= TERMINAL, "\n".join(lines)
    # The check can fail: a stamp on every row (as other metrics files carry) does not fit.
    stamped = {p: {**d, "git_commit": "0" * 40} for p, d in files.items()}
    assert max(map(len, dvc_metrics_show(stamped))) > TERMINAL


def test_a_small_runs_summary_shows_the_full_runs_table_beside_its_own(tmp_path):
    """The default run's closing summary: its headline and the committed full run's, figure by
    figure (this run / full run), read back from the full run's headline folder."""
    write_table(tmp_path / "full", DOCS)
    (tmp_path / "full" / HEADLINE_DIR / "speedup.json").write_text("{torn")  # unreadable: no row
    full = read_table(tmp_path / "full")
    assert full == {k: v for k, v in table(DOCS).items() if k != "speedup"}
    small = {"eval": {"mean": {"dspark": 1.034, "ngram": 1.696, "hybrid": 1.7}}}
    text = summary(small, "http://mlflow", "default", full=("metrics/full", full))
    lines = text.splitlines()
    at = lines.index("  headline, this run / the committed full run (metrics/full/headline):")
    assert lines[at + 1].split() == ["dspark", "ngram", "hybrid", "eagle3"]
    rows = {line.split()[0]: line for line in lines[at + 2 : at + 7]}
    assert " ".join(rows["tau"].split()) == "tau 1.034 / 1.359 1.696 / 1.742 1.7 / - - / 1.92"
    assert " ".join(rows["train_tok_s"].split()) == "train_tok_s - / 2,076 - / - - / - - / 1,463"
    assert lines[at + 6] == f"    data_tok_s  {DATA_COLUMN} - / 324"
    assert "headline, this run" not in summary(small, "http://mlflow", "full")
    # Every method at its widest figure still fits a terminal.
    wide = {row: dict.fromkeys([m for m in methods() if m != "none"], 12345) for row in TABLE_ROWS}
    text = summary({}, "x", "default", full=("metrics/full", wide))
    block = text.split("committed full run")[1].split("where to look")[0].splitlines()[1:]
    assert block and max(map(len, block)) <= TERMINAL
