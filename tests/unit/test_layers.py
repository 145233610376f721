"""The layer map of docs/architecture.md holds in the code: import-linter checks the contracts of
`.importlinter` (the map's table, by package), and the import circles stay within the issue's bound.

Both read grimp's graph of module- and function-level imports, without `if TYPE_CHECKING:` ones;
`PYTHONPATH=. python -m tests.support.import_graph` prints the circles."""

from __future__ import annotations

import configparser
import re
from pathlib import Path

from importlinter.application.use_cases import SUCCESS, lint_imports
from importlinter.configuration import configure

import rlx.errors
from tests.support.import_graph import circles, describe, rlx_graph

REPO = Path(__file__).resolve().parents[2]

# Each circle left on purpose, with its reason; at most one (issue #29). A new circle fails the test
# with its imports; one that goes must leave this table too.
ALLOWED_CIRCLES: dict[tuple[str, ...], str] = {}


def test_the_graph_is_this_trees():
    """The contracts below must judge this checkout's rlx, not an installed copy elsewhere."""
    here = Path(rlx.errors.__file__).resolve().parent
    assert here == REPO / "rlx", f"rlx imported from {here}: set PYTHONPATH to this checkout"


def test_layer_contracts_hold(capsys):
    """Every import goes down docs/architecture.md's layers (the listed upward ones excepted)."""
    configure()  # what the `lint-imports` command does first: the readers of `.importlinter`, the printer
    result = lint_imports(config_filename=str(REPO / ".importlinter"), cache_dir=None, no_logo=True)
    report = capsys.readouterr().out
    assert result == SUCCESS, report[report.find("Broken contracts"):] or report


def test_the_contract_is_the_docs_table():
    """`.importlinter`'s layers are docs/architecture.md's table: each package or module a row names
    sits in the row's layer, and every layer's package has a row."""
    config = configparser.ConfigParser()
    config.read(REPO / ".importlinter")
    layers = [line for line in config["importlinter:contract:layers"]["layers"].splitlines() if line.strip()]
    contract = {name.strip(): n for n, line in enumerate(layers, 1) for name in line.split(":")}
    section = (REPO / "docs" / "architecture.md").read_text().split("## Layers")[1].split("\n## ")[0]
    table = {}
    for layer, paths in re.findall(r"^\| (\d) \| (.+?) \|", section, flags=re.MULTILINE):
        for path in re.findall(r"`rlx/([a-z_]+)", paths):
            table.setdefault(path, set()).add(int(layer))
    assert {name: {n} for name, n in contract.items()} == table


def test_at_most_one_import_circle():
    graph = rlx_graph()
    found = {tuple(circle): circle for circle in circles(graph)}
    unexplained = ["\n".join([" <-> ".join(c), *describe(graph, c)]) for key, c in found.items()
                   if key not in ALLOWED_CIRCLES]
    assert not unexplained, "import circles (break them, e.g. import from the defining module):\n" + \
        "\n".join(unexplained)
    assert set(ALLOWED_CIRCLES) <= set(found), f"gone, drop from ALLOWED_CIRCLES: {set(ALLOWED_CIRCLES) - set(found)}"
    assert len(ALLOWED_CIRCLES) <= 1
