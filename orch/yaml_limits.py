"""Bound the YAML files of a user's config directories before Hydra composes them.

YAML aliases let a few lines stand for an exponential number of nodes ("billion laughs": nine
levels of nine aliases is 387 million values in ten lines). Hydra loads a config group's file by
constructing it whole, in C code that ignores Ctrl-C: `orch config`/`orch check` on such a file
grew for minutes and had to be killed. Here each file of the directories named on the command line
is read as a node graph (``yaml.compose``, in which an alias is the node it names, not a copy) and
its expanded size counted without expanding it; a file past the limits is refused naming it.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from orch.plans.errors import OrchError

MAX_FILE_BYTES = 8 * 1024**2
"""A config file larger than this is no hand-written config."""
MAX_EXPANDED_NODES = 1_000_000
"""Nodes a config file may stand for once its aliases are expanded (the largest shipped config has
a few hundred)."""
_SEARCHPATH_FILE = re.compile(r"file://([^,\]\s'\"]+)")


class ConfigFileRefusedError(OrchError):
    """A config file too large, too deep or expanding to too much to be composed."""


def config_dirs(flags: list[str], overrides: list[str]) -> list[Path]:
    """The directories the command line adds to Hydra's search path: ``--config-dir``/``-cd`` and
    the ``file://`` entries of a ``hydra.searchpath`` override."""
    found = []
    for i, arg in enumerate(flags):
        if arg in ("--config-dir", "-cd", "--config-path", "-cp") and i + 1 < len(flags):
            found.append(Path(flags[i + 1]))
        elif arg.startswith(("--config-dir=", "--config-path=")):
            found.append(Path(arg.split("=", 1)[1]))
    for override in overrides:
        if "hydra.searchpath" in override.split("=", 1)[0]:
            found += [Path(path) for path in _SEARCHPATH_FILE.findall(override)]
    return found


def check_config_dirs(dirs: list[Path]) -> None:
    """Refuse the first YAML file under ``dirs`` past the limits (:func:`check_yaml_file`)."""
    for root in dirs:
        if root.is_dir():
            for path in sorted([*root.rglob("*.yaml"), *root.rglob("*.yml")]):
                check_yaml_file(path)


def check_yaml_file(path: Path) -> None:
    """Refuse ``path`` if it is larger than :data:`MAX_FILE_BYTES`, nests deeper than the parser
    recurses, holds an alias to itself, or expands to more than :data:`MAX_EXPANDED_NODES` nodes.
    A file that is not valid YAML is left to Hydra, whose message names the problem."""
    fix = "Fix: write the values out, or remove the file from the config directory"
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise ConfigFileRefusedError(f"config file {path} is {size} bytes, more than {MAX_FILE_BYTES} a config may "
                                     f"be; it was not read. {fix}")
    try:
        documents = list(yaml.compose_all(path.read_bytes(), Loader=yaml.SafeLoader))
    except RecursionError:
        raise ConfigFileRefusedError(f"config file {path} nests deeper than a config can; it was not composed. "
                                     f"{fix}") from None
    except (yaml.YAMLError, UnicodeDecodeError):
        return
    expanded = _expanded_nodes([doc for doc in documents if doc is not None], path)
    if expanded > MAX_EXPANDED_NODES:
        raise ConfigFileRefusedError(
            f"config file {path}: its aliases (*name) expand to more than {MAX_EXPANDED_NODES:,} values; it was "
            f"not composed. {fix}")


def _expanded_nodes(roots: list[yaml.Node], path: Path) -> int:
    """How many nodes ``roots`` stand for with every alias expanded, counted once per node (each
    node's count is kept), without recursion; an alias inside the node it names is refused."""
    counted: dict[int, int] = {}
    in_progress: set[int] = set()
    total = 0
    for root in roots:
        stack: list[tuple[yaml.Node, bool]] = [(root, False)]
        while stack:
            node, children_done = stack.pop()
            if id(node) in counted:
                continue
            children = _children(node)
            if children_done:
                in_progress.discard(id(node))
                counted[id(node)] = min(1 + sum(counted[id(child)] for child in children), MAX_EXPANDED_NODES + 1)
                continue
            if id(node) in in_progress:
                raise ConfigFileRefusedError(f"config file {path} holds an alias inside the value it names (a "
                                             "recursive alias); it was not composed")
            in_progress.add(id(node))
            stack.append((node, True))
            stack += [(child, False) for child in children if id(child) not in counted]
        total += counted[id(root)]
    return total


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []
