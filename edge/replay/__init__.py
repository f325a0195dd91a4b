"""``sakura replay`` and ``sakura report``: every system over real traces, side by side.

``config`` (what to run, YAML with documented defaults), ``networks`` (named networks ->
real trace files and seeded start points), ``results`` (append-only JSONL, run keys,
resume), ``profile`` (the phone device profile: simulated time), ``runner`` (packs,
servers, links, the timed runs), ``report`` (Markdown + PNG figures + headline JSON),
``cli`` (the two commands). See ``edge/replay/README.md``.
"""
