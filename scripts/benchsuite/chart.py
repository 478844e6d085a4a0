"""The PNG chart: every row's speed-up against TCP, per transport, beside
the kernel's published figure (needs matplotlib: Debian's
python3-matplotlib)."""


def draw(doc, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ts = [t for t in doc["transports"] if t["name"] != "tcp"]
    rows = [(w, r) for w in doc["workloads"] for r in w["rows"] if r.get("chart", True)]
    colors = {"unix": "#8c8c8c", "smclo": "#1f77b4", "smclo-copy": "#9ecae1", "kernel-smc": "#d62728"}
    fig, ax = plt.subplots(figsize=(11, 0.5 * len(rows) + 2))
    band = 0.8 / len(ts)
    for i, (w, r) in enumerate(rows):
        y = len(rows) - 1 - i
        for j, t in enumerate(ts):
            ratio = doc["summary"]["rows"][r["key"]][t["name"]]["vs_tcp"]
            if ratio is None:
                continue
            # Better than TCP is always to the right: lower-is-better rows
            # (latency, memory, CPU) are drawn as TCP's value over ours.
            speedup = ratio if r["higher_better"] else 1 / ratio
            ax.barh(y + 0.4 - band * (j + 0.5), speedup, height=band, color=colors.get(t["name"], "#555"),
                    label=t["label"])
        if r.get("published"):
            lo, hi = r["published"]
            lo, hi = (lo, hi) if r["higher_better"] else (1 / hi, 1 / lo)
            ax.plot([lo, hi], [y, y], color="black", linewidth=3)
            ax.plot([hi], [y], marker="D", color="black", markersize=6)
    ax.plot([], [], marker="D", color="black", linestyle="none", label="kernel SMC-D lo, published (8-vCPU VM)")
    for t in ts:
        if not t["available"]:
            ax.plot([], [], linestyle="none", label="%s on this machine: unavailable" % t["label"])
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(["%s (%s)" % (r["label"][:60], r["unit"]) for _, r in reversed(rows)], fontsize=8)
    ax.set_xlabel("better than TCP loopback by (×, log scale; right is better; for latency: TCP's value ÷ ours)\n"
                  "memory per connection: see the table")
    c = doc["config"]
    ax.set_title("smclo vs TCP loopback, UNIX socket and the kernel's SMC-D loopback\n"
                 "median of %d rounds; %s; %d cores, kernel %s"
                 % (c["rounds"], where(c), doc["machine"]["cores"], doc["machine"]["kernel"]),
                 fontsize=10)
    handles, labels = ax.get_legend_handles_labels()
    seen = {}
    for h, l in zip(handles, labels):
        seen.setdefault(l, h)
    ax.legend(seen.values(), seen.keys(), loc="lower right", fontsize=8)
    ax.grid(axis="x", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def where(config):
    """The placement, short enough for a title."""
    if config.get("layout", "pinned") == "pinned":
        return "server on CPU %d, client on CPU %d" % (config["server_cpu"], config["client_cpu"])
    return "as deployed (no pinning, usual thread counts)"
