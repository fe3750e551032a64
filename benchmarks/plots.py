"""matplotlib for the benchmarks' plots, where it is installed (a GPU machine may lack it)."""


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (said once) when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return None
    return plt


def ratio_by_context(series: dict[str, tuple[list[int], list[float]]], ylabel: str, title: str,
                     path) -> None:
    """One line per label: a ratio against the context (tokens, log axis in K), 1.0 marked."""
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for label, (contexts, ratios) in series.items():
        ax.plot([c / 1024 for c in contexts], ratios, marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (K tokens)")
    ax.set_ylabel(ylabel)
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
