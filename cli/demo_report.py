"""The demo's report step (stage 3): the HTML report of the concept dictionary and its CBM."""

from __future__ import annotations

from conceptdict.cli.demo import DemoContext, StepResult


def report_step(ctx: DemoContext) -> StepResult:
    """``concepts/`` + ``cbm/`` -> ``report/index.html`` (and ``report/tokens/`` for the token concepts)."""
    from conceptdict.naming import load_cbm, load_concepts, write_report

    art = ctx.artifacts
    cbm = load_cbm(art["cbm"]) if art.get("cbm") else None
    index = write_report(load_concepts(art["concepts"]), ctx.out / "report", cbm=cbm)
    lines = [f"concept dictionary: {art['concepts']}/concepts.json", f"report:             {index}"]
    found = {"report": str(index)}
    if art.get("token_concepts"):
        tokens = write_report(load_concepts(art["token_concepts"]), ctx.out / "report" / "tokens")
        lines.append(f"token concepts:     {tokens}")
        found["token_report"] = str(tokens)
    return StepResult(found, lines)
