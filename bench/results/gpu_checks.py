"""RESULTS.md's tables of ``gpu_check.json`` (``bench.gpu.check``, merged): each optimizer on
the GPU against the CPU, the captured CUDA graphs against eager, the compiled tracked model.
A check that failed shows its error; one that did not run is named as missing."""

from bench.tools.markdown import markdown_table


def number(x) -> str:
    """A difference or a time as the tables print it (``–`` for none)."""
    return "–" if x is None else f"{x:.3g}"


def correctness_table(record: dict) -> str:
    """Per optimizer: the largest parameter and loss differences, device against CPU."""
    rows = [
        [
            name,
            number(r.get("max_param_diff")),
            number(r.get("max_param")),
            number(r.get("max_loss_diff")),
            r.get("error", ""),
        ]
        for name, r in record.get("optimizers", {}).items()
    ]
    headers = ["optimizer", "max abs param diff", "max abs param", "max loss diff", "error"]
    meta = record["meta"]
    return (
        f"Each optimizer on `{meta['device']}` against the CPU, same seed and batches, "
        f"{meta['steps']} steps (small GPT {meta['shapes']}):\n\n"
        + markdown_table(headers, rows, "lrrrl", pad=False)
    )


def captured_text(record: dict) -> str:
    """The captured graphs, their agreement with eager training and their replay times."""
    timing = record.get("timing", {})
    ms = {k: number(v * 1e3 if v else None) for k, v in timing.items()}
    return (
        f"Capturable Dobb on `{record['meta']['device']}`, graphs captured: "
        f"{', '.join(record.get('graphs', {})) or 'none'}; against eager over "
        f"{record['meta']['steps']} steps: max loss diff {number(record.get('max_loss_diff'))}, "
        f"max param diff {number(record.get('max_param_diff'))}. Steady step: replay "
        f"{ms.get('steady_replay_s', '–')} ms, eager {ms.get('steady_eager_s', '–')} ms; "
        f"refresh step: replay {ms.get('refresh_replay_s', '–')} ms, eager "
        f"{ms.get('refresh_eager_s', '–')} ms (medians)."
    )


def compiled_text(record: dict) -> str:
    """Graph breaks, graphs compiled, losses against eager, and the hooks' share."""
    hooks = record.get("hooks", {})
    share = f"{hooks['share']:.1%}" if "share" in hooks else "–"
    return (
        f"Tracked GPT compiled whole (backend `{record['meta']['backend']}`) on "
        f"`{record['meta']['device']}`: {record.get('graph_breaks', '–')} graph breaks, "
        f"{record.get('graphs_after_first_step', '–')} graphs after the first step and "
        f"{record.get('graphs_at_end', '–')} at the end, max loss diff against eager "
        f"{number(record.get('max_loss_diff'))}; the hooks' share of a compiled "
        f"forward+backward {share}."
    )


def checks_section(name: str, data: dict) -> str:
    """The subsection of one merged ``gpu_check.json`` called ``name``."""
    render = {"correctness": correctness_table, "captured": captured_text}
    render["compiled"] = compiled_text
    parts = [f"### GPU checks `{name}` (`bench.gpu.check`)"]
    for check, record in data["checks"].items():
        text = render[check](record) if "meta" in record else ""
        if "error" in record:
            text += f"\n\n{check} failed: `{record['error']}`"
        parts.append(text.strip())
    if data.get("missing"):
        parts.append(f"Did not finish: {', '.join(data['missing'])}.")
    return "\n\n".join(parts)


def solvers_section(name: str, data: dict) -> str:
    """The refresh solvers' table of ``python -m bench.results.eigensolve`` JSON (``rows``):
    ms per call, aten ops and host reads per call, worst residual; a failed method its
    error."""
    rows = []
    for r in data["rows"]:
        measured = (
            [f"{r['seconds'] * 1e3:.3f}", r["ops"], r["host_reads"], f"{r['residual']:.1e}", ""]
            if "seconds" in r
            else ["–", "–", "–", "–", r.get("error", "")]
        )
        rows.append([r["method"], r["s"], r["n"], *measured])
    headers = ["method", "s", "blocks", "ms per call", "ops", "host reads", "residual", "error"]
    return (
        f"### Refresh solvers `{name}`\n\n{data['device_name']}, torch {data['torch']}, "
        f"`{data['command']}`:\n\n" + markdown_table(headers, rows, "lrrrrrrl", pad=False)
    )
