"""The ops package's import rule: no module of one folder of kalmix/ops uses a private name (leading underscore) of
another folder's module, by ``from ... import _x`` or as ``module._x``; what op folders share is public (the Triton
helpers of kalmix/ops/common/triton_utils.py)."""
import ast
from pathlib import Path

import kalmix.ops

OPS = Path(kalmix.ops.__file__).parent


def _folder(module: str) -> str | None:
    """The folder of kalmix/ops that ``kalmix.ops.<folder>[...]`` is or lives in (None outside one)."""
    parts = module.split(".")
    return parts[2] if len(parts) >= 3 and parts[:2] == ["kalmix", "ops"] else None


def cross_folder_private_uses(root: Path) -> list[str]:
    """``path:line: name`` for every use of another folder's private name by a module ``root``/<folder>/*.py."""
    found = []
    for path in sorted(root.glob("*/*.py")):
        here, where = path.parent.name, path.relative_to(root)
        tree = ast.parse(path.read_text(), str(path))
        imported = {}                           # local name -> what another folder's import bound it to
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and _folder(node.module) not in (None, here):
                for a in node.names:
                    imported[a.asname or a.name] = f"{node.module}.{a.name}"
                    if a.name.startswith("_"):
                        found.append(f"{where}:{node.lineno}: {node.module}.{a.name}")
            elif isinstance(node, ast.Import):
                imported.update({a.asname: a.name for a in node.names if a.asname and _folder(a.name) not in
                                 (None, here)})
        found += [f"{where}:{node.lineno}: {imported[node.value.id]}.{node.attr}" for node in ast.walk(tree)
                  if isinstance(node, ast.Attribute) and node.attr.startswith("_") and
                  isinstance(node.value, ast.Name) and node.value.id in imported]
    return found


def test_no_op_folder_uses_another_folders_private_names():
    assert cross_folder_private_uses(OPS) == []


def test_the_rule_sees_both_kinds_of_use(tmp_path):
    """A ``from`` import of a private name and ``module._x`` through an imported module are found; the same
    inside one folder, and public names, are not."""
    (tmp_path / "gka").mkdir()
    (tmp_path / "common").mkdir()
    (tmp_path / "gka" / "fused.py").write_text(
        "from kalmix.ops.common.delta_triton import _dot, chunk_table\n"
        "from kalmix.ops.common import delta_triton as dt\n"
        "from kalmix.ops.gka.step import _private_but_same_folder\n"
        "x = dt._launch(1) + dt.CHUNK\n")
    (tmp_path / "common" / "a.py").write_text("from kalmix.ops.common.b import _same_folder\n")
    assert cross_folder_private_uses(tmp_path) == ["gka/fused.py:1: kalmix.ops.common.delta_triton._dot",
                                                   "gka/fused.py:4: kalmix.ops.common.delta_triton._launch"]
