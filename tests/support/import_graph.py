"""rlx's import graph as import-linter sees it, and its circles.

The graph is grimp's (import-linter's engine) over module- and function-level imports, without
those under `if TYPE_CHECKING:` (they never run), exactly as `.importlinter` builds it for the
layer contracts. A circle is a strongly connected component of more than one module: modules
that reach each other through imports, however long the way round. Run it to print them:

    PYTHONPATH=. python -m tests.support.import_graph
"""

from __future__ import annotations

import grimp


def rlx_graph() -> grimp.ImportGraph:
    """rlx's graph, rebuilt from the source (no cache: the count must describe this tree)."""
    return grimp.build_graph("rlx", exclude_type_checking_imports=True, cache_dir=None)


def circles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Every strongly connected component of more than one module, each sorted (Tarjan's
    algorithm, iterative: the graph has about 300 modules, deep enough for Python's recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            module, targets = work[-1]
            target = next(targets, None)
            if target is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[module])
                if low[module] == index[module]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == module:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif target not in index:
                index[target] = low[target] = len(index)
                stack.append(target)
                on_stack.add(target)
                work.append((target, iter(sorted(graph.find_modules_directly_imported_by(target)))))
            elif target in on_stack:
                low[module] = min(low[module], index[target])
    return sorted(found)


def describe(graph: grimp.ImportGraph, circle: list[str]) -> list[str]:
    """The imports inside one circle, as `importer:line -> imported   source line`."""
    lines = []
    for importer in circle:
        for imported in sorted(graph.find_modules_directly_imported_by(importer) & set(circle)):
            for detail in graph.get_import_details(importer=importer, imported=imported):
                lines.append(f"{importer}:{detail['line_number']} -> {imported}   {detail['line_contents']}")
    return lines


if __name__ == "__main__":
    graph = rlx_graph()
    found = circles(graph)
    print(f"{len(found)} circles over {len(graph.modules)} modules")
    for circle in found:
        print(f"- {' <-> '.join(circle)}")
        for line in describe(graph, circle):
            print(f"    {line}")
