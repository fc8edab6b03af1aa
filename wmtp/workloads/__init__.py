"""Synthetic long-context workloads (RULER constructions) with prompts of an exact token length.

``make_workload(task, tokens, tokenizer_dir, seed)`` -> record dict; ``score(task, output, answers)``;
``TASKS`` is the registry. Corpora and licences: ``corpora.py`` and ``SOURCES.md``.
"""

from wmtp.workloads.ruler import FORMAT, TASKS, make_workload, score, to_json, write_workload

__all__ = ["FORMAT", "TASKS", "make_workload", "score", "to_json", "write_workload"]
