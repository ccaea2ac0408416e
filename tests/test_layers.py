"""The package's layers: each folder imports only from the folders below it, and no two modules
import each other, however indirectly (imports inside functions count)."""

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "landmark_memory"
# a folder's rank: it may import from lower ranks and from itself, never from its own rank's others
LAYERS = {"core": 0, "kernels": 1, "index": 1, "storage": 1, "models": 2, "format": 3, "memory": 4, "uses": 5,
          "training": 5, "jobs": 6, "app": 7}
PUBLIC = {"__init__.py", "hf.py"}  # the package's face at its root: it names what users import


def modules():
    """{dotted name: path} of every module of the package."""
    out = {}
    for f in PACKAGE.rglob("*.py"):
        parts = f.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def imports(name, path, known):
    """The package's modules that module ``name`` imports (at any depth of its code)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            heads = [f"{target}.{a.name}" if f"{target}.{a.name}" in known else target for a in node.names]
        elif isinstance(node, ast.Import):
            heads = [a.name for a in node.names]
        else:
            continue
        found |= {h for h in heads if h.split(".")[0] == "landmark_memory" and h != name}
    return found


def test_every_import_points_down_a_layer_or_stays_in_its_folder():
    known, wrong = modules(), []
    for name, path in known.items():
        parts = name.split(".")
        if name in ("landmark_memory", "landmark_memory.hf"):  # the public face
            continue
        own = parts[1]
        for target in imports(name, path, known):
            layer = target.split(".")[1] if "." in target else None
            if layer != own and (layer not in LAYERS or LAYERS[layer] >= LAYERS[own]):
                wrong.append(f"{name} ({own}) imports {target}")
    assert not wrong, "imports that do not point down a layer:\n" + "\n".join(sorted(wrong))


def test_the_package_root_holds_only_its_public_face_and_the_layers():
    files = {f.name for f in PACKAGE.glob("*.py")}
    folders = {d.name for d in PACKAGE.iterdir() if (d / "__init__.py").exists()}
    assert files == PUBLIC
    assert folders == set(LAYERS)


def test_no_module_imports_itself_through_others():
    known = modules()
    face = {"landmark_memory", "landmark_memory.hf"}
    graph = {name: {t for t in imports(name, path, known) if t in known and not name.startswith(t + ".")}
             for name, path in known.items() if name not in face}  # a package's modules may use its __init__
    state = {}

    def visit(node, trail):  # depth first; a node met again on the trail closes a cycle
        state[node] = "open"
        for nxt in graph.get(node, ()):
            if state.get(nxt) == "open":
                raise AssertionError("import cycle: " + " -> ".join(trail[trail.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = "done"

    for name in graph:
        if name not in state:
            visit(name, [name])


# where one concern needs more room than 400 lines: the limit, and why it is one concern (a class is
# never split into halves that share its state to fit under the limit)
ROOMY = {
    "landmark_memory.memory.blocks": (420, "BlockMemory's store (a corpus's, or a served corpus's shares), cache, "
                                           "token ids, a reader's later blocks and what its commits write and read "
                                           "of them are one state (the keys and indexes are block_keys.py's)"),
}


def test_every_module_is_at_most_400_lines_but_the_few_that_say_why():
    long = {name: n for name, path in modules().items()
            if (n := len(path.read_text().splitlines())) > ROOMY.get(name, (400,))[0]}
    assert not long, f"modules over 400 lines (split them by concern, or say in ROOMY why they are one): {long}"
    assert set(ROOMY) <= set(modules())


ROOT = PACKAGE.parent
PY_NAME = re.compile(r"(?<![\w./-])((?:[\w-]+/)*\w+\.py)\b")


def _named_files_missing(text: str, folder: Path) -> list[str]:
    """The ``*.py`` names in ``text`` that name no file: a bare name must be a file somewhere in
    the repository's code, a path a file under ``folder``, its parent, the repository or a
    folder of the package (DESIGN.md says ``hf/convert.py`` of ``models/``)."""
    anywhere = {p.name for top in (PACKAGE, ROOT / "experiments", ROOT / "tests") for p in top.rglob("*.py")}
    bases = [folder, folder.parent, ROOT, PACKAGE, *(d.parent for d in PACKAGE.rglob("__init__.py"))]
    missing = []
    for name in PY_NAME.findall(text):
        if "/" not in name:
            ok = name in anywhere
        else:
            ok = any((base / name).is_file() for base in bases)
        if not ok:
            missing.append(name)
    return missing


def test_every_module_a_map_or_a_docstring_names_exists():
    """Docstring maps, module docstrings, DESIGN.md and its reference pages name only files that
    exist: a map that drifted from the code sends the next reader to nothing."""
    pages = [ROOT / "docs" / "DESIGN.md", *sorted((ROOT / "docs" / "design").glob("*.md"))]
    missing = [f"{page.relative_to(ROOT)}: {n}" for page in pages
               for n in _named_files_missing(page.read_text(), PACKAGE)]
    for path in modules().values():
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        missing += [f"{path.relative_to(ROOT)}: {n}" for n in _named_files_missing(doc, path.parent)]
    assert not missing, "files named that do not exist:\n" + "\n".join(missing)


def test_the_design_page_reads_in_fifteen_minutes_and_links_every_reference_page():
    """DESIGN.md stays the picture a newcomer reads whole (at most 400 lines); the detail lives in
    its reference pages, each linked from it."""
    design = (ROOT / "docs" / "DESIGN.md").read_text()
    assert len(design.splitlines()) <= 400
    pages = sorted(p.name for p in (ROOT / "docs" / "design").glob("*.md"))
    assert pages and all(f"(design/{name})" in design for name in pages)


def test_each_packages_map_lists_every_module_of_its_folder():
    """A package whose docstring is a map of its modules (one line each, ``name.py  what it
    does``) lists all of them."""
    unlisted = []
    for init in PACKAGE.rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        listed = set(re.findall(r"^\s+(\w+\.py)\s", doc, re.M))
        if len(listed) < 3:  # not a map
            continue
        unlisted += [f"{init.parent.relative_to(ROOT)}/{f.name}" for f in sorted(init.parent.glob("*.py"))
                     if f.name != "__init__.py" and f.name not in listed]
    assert not unlisted, "modules a package's map leaves out:\n" + "\n".join(unlisted)


PARTS = {"_blocks", "_lookup", "_decoder", "_files"}  # a LandmarkMemory's parts (memory/engine.py)


def test_nothing_but_the_engine_reaches_into_a_memorys_parts():
    """``LandmarkMemory`` is the one door to its parts: no module of the package or of the
    experiments but ``memory/engine.py`` names them on another object than itself (the tests
    that peek inside, at the kernels' tables or the key rows read, name them as private)."""
    from landmark_memory import LandmarkMemory

    engine, reaches = PACKAGE / "memory" / "engine.py", []
    for path in [*PACKAGE.rglob("*.py"), *(ROOT / "experiments").rglob("*.py")]:
        if path == engine:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in PARTS and \
                    not (isinstance(node.value, ast.Name) and node.value.id == "self"):
                reaches.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not reaches, "reaches into a memory's parts (ask LandmarkMemory instead):\n" + "\n".join(reaches)
    assert not {p.lstrip("_") for p in PARTS} & set(dir(LandmarkMemory))  # no public name hands a part out


def test_the_readmes_layout_names_every_folder_of_the_package_and_nothing_else():
    """The README's layout lists each folder of the package in its layer order, and each of the
    repository's top folders, and no folder that is not there."""
    readme = (ROOT / "README.md").read_text()
    layout = re.search(r"^## Layout\n+```\n(.*?)```", readme, re.S | re.M).group(1)
    listed = re.findall(r"^  (\w+)/ ", layout, re.M)
    folders = {d.name for d in PACKAGE.iterdir() if d.is_dir() and not d.name.startswith("__")}
    assert sorted(listed) == sorted(folders), f"README layout lists {listed}, the package holds {sorted(folders)}"
    ranked = [f for f in listed if f in LAYERS]
    assert ranked == sorted(ranked, key=LAYERS.get), f"README layout is not in layer order: {ranked}"
    tops = re.findall(r"^(\w+)/ ", layout, re.M)
    assert tops and all((ROOT / t).is_dir() for t in tops), tops


def test_ci_runs_the_readmes_test_command_as_written():
    """CI's first step is the README's second set-up command, word for word: lint, then the tests;
    its failure ends CI (set -e spares a failure inside an && list)."""
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"^python3 -m venv .*$", readme, re.M)
    assert len(commands) == 2, commands
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert commands[1] in lines
    assert lines[lines.index(commands[1]) + 1].startswith('status=$?; if [ "$status" -ne 0 ]; then exit "$status"; fi')
    assert "ruff check" in commands[1] and commands[1].endswith('pytest -m "not slow"')


def test_no_module_outside_the_engine_imports_a_part():
    """The engine's parts (blocks, lookup, decoder, saved files) are imported only inside ``memory/``:
    the rest of the package reaches a memory through ``LandmarkMemory`` and its typed objects."""
    parts = {f"landmark_memory.memory.{m}" for m in ("blocks", "lookup", "decoding", "saved", "block_keys")}
    known = modules()
    assert parts <= set(known), f"parts renamed or gone: {sorted(parts - set(known))}"
    reaches = [f"{name} imports {t}" for name, path in known.items() if not name.startswith("landmark_memory.memory")
               for t in imports(name, path, known) if t in parts or any(t.startswith(p + ".") for p in parts)]
    assert not reaches, "\n".join(reaches)


def test_no_test_module_imports_another():
    """Tests share fixtures through conftest.py and helpers through modules that are not tests
    (helpers.py, hf_tiny.py, kernel_cases.py): a test module imported by another runs its
    module-level code twice and hides what it shares."""
    tests = ROOT / "tests"
    found = [f"{p.name} imports {n.module}" for p in tests.glob("*.py") for n in ast.walk(ast.parse(p.read_text()))
             if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("test_")]
    assert not found, "\n".join(found)


# LandmarkMemory's public names, each in DESIGN.md ("The memory's parts"): a new one is a decision
ENGINE_NAMES = {
    "methods": {"forward", "tokens", "keys", "querying", "reading", "end_document", "attach", "add_document",
                "commit", "open", "refresh", "open_chunk", "rewind", "close"},
    "attributes": {"model", "backbone", "shape", "device", "retrieval_stats", "inputs", "attachment"},
    "properties": {"inspection", "transfer", "text_index", "options", "generate", "streams", "n_blocks", "n_tokens",
                   "pending_count", "observer", "dir", "readonly", "documents", "manifest"},
}


def test_the_engines_public_names_are_the_narrow_door():
    """``LandmarkMemory`` has the public names listed above and no other: its methods, the
    attributes its ``__init__`` sets, and its properties (what experiments and tests look at is
    ``inspection``'s, what goes between processes ``transfer``'s)."""
    cls = next(n for n in ast.parse((PACKAGE / "memory" / "engine.py").read_text()).body
               if isinstance(n, ast.ClassDef) and n.name == "LandmarkMemory")
    found = {"methods": set(), "attributes": set(), "properties": set()}
    for node in cls.body:
        if isinstance(node, ast.FunctionDef):
            is_property = any(ast.unparse(d) == "property" for d in node.decorator_list)
            found["properties" if is_property else "methods"].add(node.name)
        elif isinstance(node, ast.Assign):
            found["properties"] |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    for node in ast.walk(init):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and ast.unparse(node.value) == "self":
            found["attributes"].add(node.attr)
    public = {kind: {n for n in names if not n.startswith("_")} for kind, names in found.items()}
    assert public == ENGINE_NAMES
    assert len(public["methods"]) + len(public["attributes"]) <= 21
