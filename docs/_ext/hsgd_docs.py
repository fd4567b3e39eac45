"""Sphinx pieces that keep the site in step with the code.

- ``hsgd-trainer-options``: the trainer's reference, one table per section of
  :class:`hsgd._trainer.config.TrainConfig` (and one of the modes' settings,
  the flags it derives from them), built from the very parser that prints
  ``python -m hsgd.train --help`` (flag, default, choices, help text), so the
  page cannot drift from ``--help``.
- ``hsgd-api``: the API reference, one autodoc entry per name in
  ``hsgd.__all__``, grouped by the module that defines it. A name whose module
  has no group here is a warning (so a new export is never left off), and so
  is any public name without a docstring (``autodoc-process-docstring``).
  With ``-W`` (CI) each warning fails the build.
- Members inherited from outside hsgd (``torch.optim.Optimizer``'s) are left
  out of the exported classes' pages: torch documents them.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
from typing import Any, Dict, List, Optional, Tuple

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles

logger = logging.getLogger(__name__)

# The module that defines an export (hsgd._EXPORTS) -> the API page's section for it, in page order.
API_SECTIONS: List[Tuple[str, Tuple[str, ...]]] = [
    ("Synchronization modes", ("._engine.mode", ".hierarchical", ".box", ".gossip")),
    ("Remote memory", (".remote",)),
    ("Nodes, devices, data and load balancing", (".topology", ".devices", ".parallel_io", ".balance")),
    ("Optimizers and schedules", (".lars", ".schedules")),
    ("Collectives and replicas", (".collectives", ".replicas")),
    ("Errors", (".errors",)),
]

_SECTION_COMMENT = re.compile(r"^\s*# --- (.+?) ---\s*$")
_FIELD_LINE = re.compile(r"^\s{4}(\w+):")


def _is_public(name: str) -> bool:
    return not name.split(".")[-1].startswith("_")


MODES_SECTION = "synchronization modes' settings"  # after "synchronization"


def trainer_sections() -> List[Tuple[str, List[str]]]:
    """TrainConfig's own fields in the sections its source marks with ``# --- name ---`` comments,
    and the modes' (:data:`hsgd._trainer.mode_flags.ModeFlags`) in a section of their own."""
    from hsgd._trainer.config import TrainConfig
    from hsgd._trainer.mode_flags import ModeFlags

    modes = [f.name for f in dataclasses.fields(ModeFlags)]
    names = {f.name for f in dataclasses.fields(TrainConfig)} - set(modes)
    sections: List[Tuple[str, List[str]]] = []
    for line in inspect.getsource(TrainConfig).splitlines():
        heading = _SECTION_COMMENT.match(line)
        if heading:
            sections.append((heading.group(1), []))
            continue
        field = _FIELD_LINE.match(line)
        if field and field.group(1) in names:
            if not sections:
                sections.append(("options", []))
            sections[-1][1].append(field.group(1))
    listed = [name for _, fields in sections for name in fields]
    missing = names - set(listed)
    if missing:  # a field the source scan did not see: better an error than a page without it
        raise RuntimeError(f"TrainConfig fields not found in its source: {sorted(missing)}")
    after = next((i + 1 for i, (title, _) in enumerate(sections) if title == "synchronization"), len(sections))
    sections.insert(after, (MODES_SECTION, modes))
    return sections


def _cell(text: str) -> str:
    """Help text as literal reST: markup characters escaped, one line."""
    text = re.sub(r"([\\*`|])", r"\\\1", text.replace("\n", " "))
    return re.sub(r"(\w)_(?=\W|$)", r"\1\\_", text)


def _parsed(directive: SphinxDirective, lines: List[str]) -> List[nodes.Node]:
    """``lines`` of reST (section titles allowed) parsed where ``directive`` stands."""
    container = nodes.section()
    container.document = directive.state.document
    nested_parse_with_titles(directive.state, StringList(lines, source=directive.name), container)
    return list(container.children)


class TrainerOptions(SphinxDirective):
    """The trainer's options, from the parser of ``python -m hsgd.train --help``."""

    has_content = False

    def run(self) -> List[nodes.Node]:
        from hsgd._trainer.config import build_parser

        parser = build_parser(quiet=True)
        formatter = parser._get_formatter()
        by_dest: Dict[str, argparse.Action] = {a.dest: a for a in parser._actions}
        lines: List[str] = []
        for title, fields in trainer_sections():
            lines += [title[0].upper() + title[1:], "-" * len(title), "",
                      ".. list-table::", "   :header-rows: 1", "   :widths: 25 15 60", "",
                      "   * - option", "     - default", "     - what it does"]
            for name in fields:
                action = by_dest[name]
                flags = ", ".join(action.option_strings)
                if isinstance(action, argparse.BooleanOptionalAction):
                    flags = " / ".join(action.option_strings)
                elif action.metavar or action.choices is None:
                    flags += " " + (action.metavar or name.upper())
                help_text = _cell(formatter._expand_help(action).removesuffix(f" (default: {action.default})"))
                if action.choices is not None:
                    help_text += " Choices: " + ", ".join(f"``{c}``" for c in action.choices) + "."
                lines += [f"   * - ``{flags}``", f"     - ``{action.default!r}``", f"     - {help_text}"]
            lines.append("")
        self.env.note_dependency(inspect.getsourcefile(build_parser) or "")
        return _parsed(self, lines)


class ApiReference(SphinxDirective):
    """One autodoc entry per name in ``hsgd.__all__``, grouped as :data:`API_SECTIONS` says."""

    has_content = False

    def run(self) -> List[nodes.Node]:
        import hsgd

        exports: Dict[str, str] = dict(hsgd._EXPORTS)
        names = [name for name in hsgd.__all__ if name != "__version__"]
        grouped = {title: [n for n in names if exports[n] in modules] for title, modules in API_SECTIONS}
        placed = {n for group in grouped.values() for n in group}
        for name in names:
            if name not in placed:
                logger.warning(f"hsgd.{name} (from hsgd{exports[name]}) has no section in docs/_ext/hsgd_docs.py "
                               "API_SECTIONS; add its module there", location=self.get_location())
        lines: List[str] = []
        for title, group in grouped.items():
            if not group:
                continue
            lines += [title, "-" * len(title), ""]
            for name in group:
                lines += self._entry(name, getattr(hsgd, name))
        return _parsed(self, lines)

    @staticmethod
    def _entry(name: str, obj: Any) -> List[str]:
        if inspect.isclass(obj) and issubclass(obj, BaseException):
            return [f".. autoexception:: hsgd.{name}", "   :members:", ""]
        if inspect.isclass(obj):
            return [f".. autoclass:: hsgd.{name}", "   :members:", "   :inherited-members:", ""]
        return [f".. autofunction:: hsgd.{name}", ""]


def _defined_in_hsgd(obj: Any) -> bool:
    module = getattr(obj, "__module__", None)
    if module is None and isinstance(obj, property) and obj.fget is not None:
        module = obj.fget.__module__
    return bool(module) and (module == "hsgd" or module.startswith("hsgd."))


def skip_member(app: Sphinx, what: str, name: str, obj: Any, skip: bool, options: Any) -> Optional[bool]:
    """Leave out members inherited from outside hsgd (torch's Optimizer methods) and private ones."""
    if what in ("class", "exception") and name != "__init__":
        if not _is_public(name):
            return True
        if not _defined_in_hsgd(obj):
            return True
    return None


def require_docstring(app: Sphinx, what: str, name: str, obj: Any, options: Any, lines: List[str]) -> None:
    """A public name of hsgd without a docstring is a warning (an error under -W)."""
    if what == "module" or not _is_public(name):
        return
    if not any(line.strip() for line in lines):
        logger.warning(f"{name} ({what}) has no docstring; every public name of hsgd needs one",
                       type="hsgd", subtype="docstring")


def setup(app: Sphinx) -> Dict[str, Any]:
    app.add_directive("hsgd-trainer-options", TrainerOptions)
    app.add_directive("hsgd-api", ApiReference)
    app.connect("autodoc-skip-member", skip_member)
    app.connect("autodoc-process-docstring", require_docstring)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
