"""Writes a sweep's results: JSON, a Markdown summary and PNG plots."""

from __future__ import annotations

import collections
import json
import os
from typing import Iterable

from . import model


def write_json(path: str, records: list, env: dict, meta: dict) -> None:
    with open(path, "w") as f:
        json.dump(dict(environment=env, meta=meta, records=records), f, indent=1, default=str)


def headline_us(g: dict) -> float | None:
    """The figure every table and plot shows: scheduled time, or the ideal
    model's where no schedule could be read (the record says why)."""
    return g.get("scheduled_us") or g.get("modeled_us")


def _cell(g: dict | None) -> str:
    if not g:
        return ""
    if g.get("status") == "skipped":
        return "skip"
    if g.get("status") != "ok":
        return "err"
    mark = "" if g.get("compiles") in (True, None) else "✗ "
    ideal = g.get("modeled_us")
    sched = g.get("scheduled_us")
    roof = g.get("roofline_us")
    if sched is None:
        x = f" ({ideal / roof:.2f}×)" if roof else ""
        return f"{mark}ideal {ideal:,.1f}{x}"
    x = f" ({sched / roof:.2f}×)" if roof else ""
    return f"{mark}{sched:,.1f}{x} · ideal {ideal:,.0f}"


def _stall_us(g: dict, gen: str) -> str:
    from . import schedule

    cyc = [l["schedule"]["stall_cycles"] for l in g.get("launches", []) if l.get("schedule")]
    return f"{sum(cyc) / schedule.clock_hz(gen) * 1e6:,.1f}" if cyc else ""


def _binding(g: dict) -> str:
    """Slot class binding the hottest loop of the costliest launch."""
    best = None
    for l in g.get("launches", []):
        s = l.get("schedule")
        if s and s.get("hot_loops") and (best is None or s["seconds"] > best["seconds"]):
            best = s
    if not best:
        return ""
    h = best["hot_loops"][0]
    return f"{best['name']}: {h['binding']} ({h['body_bundles']} bundles, floor {h['floor_bundles']:.0f}) ×{h['iterations']}"


def _impl_order(records: Iterable[dict]) -> list[str]:
    seen = []
    for r in records:
        if r["impl"] not in seen:
            seen.append(r["impl"])
    return seen


def _point_key(r: dict) -> tuple:
    if r["kernel"] == "moe":
        return (r["model"], r["routing"], r["tokens"])
    if r["kernel"] == "rmsnorm":
        return (r["hidden"], r["tokens"], r.get("variant", "plain"), r.get("direction", "fwd"))
    if r["kernel"] == "decode_attention":
        return (r["context"], r["batch"], r["cache_len"], r["q_heads"], r["kv_heads"])
    return (
        r["seq"],
        r.get("direction", "fwd"),
        r["batch"],
        r["q_heads"],
        r["kv_heads"],
        r["head_dim"],
        r.get("window", "-"),
    )


_POINT_COLS = {
    "moe": ["model", "routing", "tokens"],
    "rmsnorm": ["hidden", "tokens", "variant", "direction"],
    "attention": ["seq", "window", "direction", "batch", "q_heads", "kv_heads", "head_dim"],
    "decode_attention": ["context", "batch", "cache_len", "q_heads", "kv_heads", "head_dim"],
}


def markdown(records: list, env: dict, meta: dict) -> str:
    from . import schedule

    out = ["# Modeled TPU performance", ""]
    out.append(
        "Headline: **scheduled time**. Each Pallas launch is compiled for the "
        "generation and the TPU compiler's final VLIW bundle schedule is executed "
        "with the launch's own scalar-prefetch values (bench/llo.py): bundles "
        "issued + cycles stalled on DMA waits (one HBM pipe at the device's "
        "bandwidth, a fixed latency per DMA), over the assumed clock. XLA parts "
        "are charged the same way, from each of their fusions' own bundles "
        "(bench/xla_fusions.py; a fusion whose run could not know a value read "
        "from memory at least its HBM operands at copy bandwidth). Cells: scheduled µs (× roofline) · ideal µs, the ideal model "
        "being max(bytes / BW, flops / peak) + grid steps × step overhead. "
        "✗ = does not compile for that generation. `measured` columns are "
        "filled only on a real TPU."
    )
    out.append("")
    out.append(
        "| generation | bf16 TFLOP/s | HBM GB/s | clock GHz (assumed) | DMA latency µs (assumed) | step overhead µs (ideal model) |"
    )
    out.append("|---|---|---|---|---|---|")
    for c in model.CHIPS.values():
        out.append(
            f"| {c.name} | {c.peak_flops / 1e12:.0f} | "
            f"{c.hbm_bytes_per_s / 1e9:.0f} | {schedule.clock_hz(c.name) / 1e9:.2f} | "
            f"{schedule.DMA_LATENCY_S * 1e6:.2f} | {c.step_overhead_s * 1e6:.2f} |"
        )
    out.append("")
    out.append(
        f"Environment: jax {env.get('jax')}, libtpu {env.get('libtpu')}, "
        f"backend {env.get('backend')}, {meta.get('elapsed_s', 0):.0f} s "
        f"on {env.get('cpus')} CPUs."
    )
    out.append("")
    gens = meta.get("generations", list(model.CHIPS))
    by_kernel = collections.defaultdict(list)
    for r in records:
        by_kernel[r["kernel"]].append(r)
    for kernel, recs in by_kernel.items():
        impls = _impl_order(recs)
        table = collections.OrderedDict()
        for r in recs:
            table.setdefault(_point_key(r), {})[r["impl"]] = r
        cols = _POINT_COLS[kernel]
        for gen in gens:
            out.append(f"## {kernel} — {gen}: scheduled µs (× roofline) · ideal µs")
            out.append("")
            out.append("| " + " | ".join(cols + ["roofline µs"] + impls) + " |")
            out.append("|" + "---|" * (len(cols) + 1 + len(impls)))
            for key, row in table.items():
                any_rec = next(iter(row.values()))
                roof = any_rec["per_generation"].get(gen, {}).get("roofline_us")
                cells = [str(any_rec.get(c, "")) for c in cols]
                cells.append(f"{roof:,.1f}" if roof else "")
                cells += [_cell(row.get(i, {}).get("per_generation", {}).get(gen)) for i in impls]
                out.append("| " + " | ".join(cells) + " |")
            out.append("")
        # Details on one generation: traffic and work against the minimum.
        gen = "v6e" if "v6e" in gens else gens[0]
        out.append(f"## {kernel} — traffic and work ({gen})")
        out.append("")
        out.append(
            "| " + " | ".join(cols) + " | impl | HBM bytes / min | issued / "
            "useful flops | grid steps | compiles ("
            + ", ".join(gens)
            + ") | DMA issues | DMA stall µs | hottest loop: binding slot | measured µs |"
        )
        out.append("|" + "---|" * (len(cols) + 9))
        for key, row in table.items():
            for impl in impls:
                r = row.get(impl)
                if r is None:
                    continue
                g = r["per_generation"].get(gen, {})
                if g.get("status") != "ok":
                    continue
                comp = ", ".join(
                    {True: "yes", False: "no", None: "-"}[
                        r["per_generation"].get(x, {}).get("compiles")
                    ]
                    for x in gens
                )
                meas = g.get("measured_us")
                out.append(
                    "| "
                    + " | ".join(str(r.get(c, "")) for c in cols)
                    + f" | {impl} | {g['bytes_over_min']:.2f} | "
                    f"{g['flops_over_useful']:.2f} | {g.get('pallas_steps', 0)} | "
                    f"{comp} | {g.get('dma_issues', 0)} | {_stall_us(g, gen)} | "
                    f"{_binding(g)} | "
                    f"{'' if meas is None else f'{meas:.1f}'} |"
                )
        out.append("")
        skipped = {
            (r["impl"], g.get("reason"))
            for r in recs
            for g in r["per_generation"].values()
            if g.get("status") in ("skipped", "error")
        }
        if skipped:
            out.append(f"### {kernel}: skipped / failed")
            out.append("")
            for impl, reason in sorted(skipped, key=str):
                out.append(f"- {impl}: {reason}")
            out.append("")
    return "\n".join(out) + "\n"


def summary(records: list, gens: list) -> str:
    """One line per point and generation: every implementation's scheduled µs
    (× roofline) and ideal µs, for the terminal."""
    out = []
    table = collections.OrderedDict()
    for r in records:
        table.setdefault((r["kernel"], _point_key(r)), {})[r["impl"]] = r
    for (kernel, key), row in table.items():
        label = f"{kernel} " + " ".join(str(k) for k in key)
        for gen in gens:
            cells = []
            for impl, r in row.items():
                g = r["per_generation"].get(gen, {})
                cells.append(f"{impl} {_cell(g)}")
            roof = next(iter(row.values()))["per_generation"].get(gen, {}).get("roofline_us")
            out.append(f"{label} [{gen}, roofline {roof or 0:,.1f} µs]: " + "; ".join(cells))
    return "\n".join(out)


def plots(out_dir: str, records: list, gens: list) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    moe = [r for r in records if r["kernel"] == "moe"]
    models = []
    for r in moe:
        if r["model"] not in models:
            models.append(r["model"])
    impls = _impl_order(moe)
    colors = {i: plt.cm.tab10(k % 10) for k, i in enumerate(impls)}
    styles = {"uniform": "-", "zipf": "--"}
    for m in models:
        recs = [r for r in moe if r["model"] == m]
        fig, axes = plt.subplots(1, len(gens), figsize=(5.2 * len(gens), 4.2), squeeze=False)
        for ax, gen in zip(axes[0], gens):
            for impl in impls:
                for routing, ls in styles.items():
                    pts = sorted(
                        (
                            r["tokens"],
                            r["per_generation"][gen].get("scheduled_tokens_per_s")
                            or r["per_generation"][gen].get("tokens_per_s"),
                        )
                        for r in recs
                        if r["impl"] == impl
                        and r["routing"] == routing
                        and r["per_generation"].get(gen, {}).get("status") == "ok"
                    )
                    pts = [(t, v) for t, v in pts if v]
                    if pts:
                        ax.plot(
                            *zip(*pts),
                            ls,
                            marker="o",
                            ms=3,
                            color=colors[impl],
                            label=f"{impl} ({routing})",
                        )
            roof = sorted(
                {
                    (r["tokens"], r["tokens"] / (r["per_generation"][gen]["roofline_us"] * 1e-6))
                    for r in recs
                    if r["routing"] == "uniform"
                    and r["per_generation"].get(gen, {}).get("roofline_us")
                }
            )
            if roof:
                ax.plot(*zip(*roof), ":", color="k", label="roofline (uniform)")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("tokens")
            ax.set_ylabel("scheduled tokens/s per MoE layer")
            ax.set_title(f"{m} — {gen}")
            ax.grid(alpha=0.3, which="both")
        if axes[0][-1].get_legend_handles_labels()[0]:
            axes[0][-1].legend(fontsize=6, loc="lower right")
        fig.tight_layout()
        path = os.path.join(out_dir, f"moe_throughput_{m}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(path)

    # Speedup over the default path (the registry's baseline) per Pallas impl.
    base = next((r["impl"] for r in moe if r.get("baseline")), None)
    if base and models:
        fig, axes = plt.subplots(
            len(models), len(gens), figsize=(5.2 * len(gens), 3.4 * len(models)), squeeze=False
        )
        for row, m in zip(axes, models):
            recs = [r for r in moe if r["model"] == m]
            basemap = {(r["routing"], r["tokens"]): r for r in recs if r["impl"] == base}
            for ax, gen in zip(row, gens):
                for impl in impls:
                    if impl == base:
                        continue
                    for routing, ls in styles.items():
                        pts = []
                        for r in recs:
                            if r["impl"] != impl or r["routing"] != routing:
                                continue
                            g = r["per_generation"].get(gen, {})
                            b = (
                                basemap.get((routing, r["tokens"]), {})
                                .get("per_generation", {})
                                .get(gen, {})
                            )
                            if g.get("status") == "ok" and b.get("status") == "ok":
                                pts.append((r["tokens"], headline_us(b) / headline_us(g)))
                        if pts:
                            pts.sort()
                            lw = 2.2 if any(r.get("ours") for r in recs if r["impl"] == impl) else 1
                            ax.plot(
                                *zip(*pts),
                                ls,
                                marker="o",
                                ms=3,
                                lw=lw,
                                color=colors[impl],
                                label=f"{impl} ({routing})",
                            )
                ax.axhline(1.0, color="k", lw=0.8)
                ax.set_xscale("log", base=2)
                ax.set_yscale("log")
                ax.set_title(f"{m} — {gen}: speedup over {base}", fontsize=9)
                ax.set_xlabel("tokens")
                ax.grid(alpha=0.3, which="both")
            if row[-1].get_legend_handles_labels()[0]:
                row[-1].legend(fontsize=6)
        fig.tight_layout()
        path = os.path.join(out_dir, "moe_speedup.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        files.append(path)
    files += _decode_attention_plot(plt, out_dir, records, gens)
    return files


def _decode_attention_plot(plt, out_dir, records, gens) -> list[str]:
    """Scheduled time over the KV-bytes roofline against batch, one line per
    implementation and context (1.0 = the cache read at full HBM bandwidth)."""
    recs = [r for r in records if r["kernel"] == "decode_attention"]
    if not recs:
        return []
    impls = _impl_order(recs)
    contexts = sorted({r["context"] for r in recs})
    colors = {i: plt.cm.tab10(k % 10) for k, i in enumerate(impls)}
    styles = ["-", "--", ":", "-."]
    fig, axes = plt.subplots(1, len(gens), figsize=(5.2 * len(gens), 4.2), squeeze=False)
    for ax, gen in zip(axes[0], gens):
        for impl in impls:
            for n, ls in zip(contexts, styles * 4):
                pts = []
                for r in recs:
                    g = r["per_generation"].get(gen, {})
                    if r["impl"] == impl and r["context"] == n and g.get("status") == "ok":
                        pts.append((r["batch"], headline_us(g) / g["roofline_us"]))
                if pts:
                    ax.plot(
                        *zip(*sorted(pts)),
                        ls,
                        marker="o",
                        ms=3,
                        color=colors[impl],
                        label=f"{impl} ({n} ctx)",
                    )
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch (sequences)")
        ax.set_ylabel("scheduled time / KV-bytes roofline")
        ax.set_title(f"decode attention — {gen}")
        ax.grid(alpha=0.3, which="both")
    if axes[0][-1].get_legend_handles_labels()[0]:
        axes[0][-1].legend(fontsize=6)
    fig.tight_layout()
    path = os.path.join(out_dir, "decode_attention.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [path]


def write_all(out_dir: str, records: list, env: dict, meta: dict) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    files = [os.path.join(out_dir, "results.json"), os.path.join(out_dir, "results.md")]
    write_json(files[0], records, env, meta)
    with open(files[1], "w") as f:
        f.write(markdown(records, env, meta))
    try:
        files += plots(out_dir, records, list(meta.get("generations", model.CHIPS)))
    except Exception as e:  # noqa: BLE001 - plots are a convenience
        meta.setdefault("warnings", []).append(f"plots failed: {e}")
    return files
