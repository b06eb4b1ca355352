"""Calibration and held-out text for quantization and ``kiln eval``.

The default corpus is English prose read at run time from the docstrings of a fixed list of
Python standard-library modules: nothing is downloaded and no third-party text is stored in
the repository. It is deterministic for a given Python version. ``split_corpus`` divides it
into a calibration half (for quantization scales) and a held-out half (for measuring
quality), interleaving paragraphs so that both halves cover the same topics.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
from pathlib import Path

from kiln.errors import ConfigError, bad_value

# Pure-Python modules (or C modules with fixed docstrings) whose documentation does not
# depend on the platform. Order matters: it is the corpus order.
CORPUS_MODULES: tuple[str, ...] = (
    "json",
    "collections",
    "argparse",
    "pathlib",
    "logging",
    "textwrap",
    "functools",
    "itertools",
    "re",
    "datetime",
    "string",
    "difflib",
    "heapq",
    "bisect",
    "fractions",
    "statistics",
    "calendar",
    "csv",
    "dataclasses",
    "enum",
    "typing",
    "contextlib",
    "configparser",
    "pprint",
    "queue",
    "sched",
    "urllib.parse",
    "shlex",
    "fnmatch",
    "random",
)

_MIN_PARAGRAPH_CHARS = 40
_MIN_LETTER_SHARE = 0.6


def _docs_of(module_name: str) -> list[str]:
    """Docstrings of a module, its public classes and functions, and their public methods,
    in a fixed order (the module, then members by name)."""
    mod = importlib.import_module(module_name)
    docs = [inspect.getdoc(mod) or ""]
    names = getattr(mod, "__all__", None) or [n for n in dir(mod) if not n.startswith("_")]
    for name in sorted(names):
        obj = getattr(mod, name, None)
        if not (inspect.isclass(obj) or inspect.isroutine(obj)):
            continue
        owner = getattr(obj, "__module__", "") or ""
        if not owner.lstrip("_").startswith(module_name.split(".")[0]):
            continue  # re-exported from another module
        docs.append(obj.__doc__ or "")
        if inspect.isclass(obj):
            for attr in sorted(vars(obj)):
                member = vars(obj)[attr]
                if not attr.startswith("_") and inspect.isroutine(member):
                    docs.append(getattr(member, "__doc__", None) or "")
    return [inspect.cleandoc(d) for d in docs if d]


def _is_prose(paragraph: str) -> bool:
    if len(paragraph) < _MIN_PARAGRAPH_CHARS or paragraph.endswith("::"):
        return False
    if any(line.lstrip().startswith((">>>", "...", "$ ", "%")) for line in paragraph.splitlines()):
        return False
    letters = sum(c.isalpha() or c == " " for c in paragraph)
    return letters / len(paragraph) >= _MIN_LETTER_SHARE


@functools.cache
def default_corpus() -> str:
    """English text from standard-library docstrings: paragraphs (each on one line) separated
    by blank lines, without duplicates or code examples. About 150,000 characters."""
    seen: set[str] = set()
    paragraphs: list[str] = []
    for name in CORPUS_MODULES:
        for doc in _docs_of(name):
            for block in re.split(r"\n\s*\n", doc):
                para = " ".join(block.split())
                if para not in seen and _is_prose(para):
                    seen.add(para)
                    paragraphs.append(para)
    return "\n\n".join(paragraphs)


def paragraphs(text: str) -> list[str]:
    """The non-empty paragraphs of ``text`` (split at blank lines), stripped."""
    return [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]


def split_corpus(text: str, calib_fraction: float = 0.5) -> tuple[str, str]:
    """Split ``text`` at paragraph boundaries into (calibration, held-out) text.

    Paragraphs are dealt out in order, ``calib_fraction`` of them to the calibration half,
    spread evenly (0.5 alternates), so both halves cover the same topics. Deterministic."""
    if not 0.0 < calib_fraction < 1.0:
        raise bad_value("calib_fraction", calib_fraction, "it must be in (0, 1)")
    paras = paragraphs(text)
    calib: list[str] = []
    heldout: list[str] = []
    for i, para in enumerate(paras):
        # paragraph i goes to calib when the running share of calib crosses an integer
        to_calib = int((i + 1) * calib_fraction) > int(i * calib_fraction)
        (calib if to_calib else heldout).append(para)
    if not calib or not heldout:
        raise ConfigError(
            f"the text has {len(paras)} paragraph(s); splitting it with "
            f"calib_fraction={calib_fraction} leaves one half empty: give a longer text with "
            "paragraphs separated by blank lines."
        )
    return "\n\n".join(calib), "\n\n".join(heldout)


class TextFileError(ConfigError):
    """A text file that cannot be used: missing, a directory, unreadable, not UTF-8 or
    blank. ``reason`` is the short phrase (with the path) that callers can quote."""

    def __init__(self, path: Path, problem: str, advice: str = "") -> None:
        self.reason = f"text file {str(path)!r} {problem}"
        super().__init__(f"{self.reason}{advice}.")


def load_text(path: str | Path | None = None, part: str = "heldout") -> str:
    """The text of a UTF-8 file; without a path, the ``part`` ("heldout" or "calib") half of
    ``default_corpus()``. Raises ``TextFileError`` (a ``ConfigError``) naming the path when
    the file is missing, unreadable, not UTF-8 or blank."""
    if path is None:
        if part not in ("heldout", "calib"):
            raise bad_value("part", part, 'one of "heldout", "calib"')
        calib, heldout = split_corpus(default_corpus())
        return heldout if part == "heldout" else calib
    p = Path(path).expanduser()
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TextFileError(p, "does not exist") from None
    except IsADirectoryError:
        raise TextFileError(p, "is a directory, not a file") from None
    except UnicodeDecodeError as e:
        raise TextFileError(p, f"is not UTF-8 ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise TextFileError(p, f"cannot be read ({e.strerror})") from None
    if not text.strip():
        raise TextFileError(p, "is blank", "; give a file with text in it")
    return text
