"""Results as text for a terminal (what the command line prints); each returns a string and prints nothing."""

from __future__ import annotations

from conceptdict.naming import ConceptDictionary, NamedSummary
from conceptdict.naming.reports.report_text import format_cbm, format_concept, format_concepts, format_ranking
from conceptdict.naming.scoring import format_summary

__all__ = ["format_cbm", "format_concept", "format_concepts", "format_ranking", "format_scores"]


def format_scores(cd: ConceptDictionary | NamedSummary) -> str:
    """What ``conceptdict score`` prints: which scorers ran with which negatives, the summary, the LLM usage."""
    info = cd.meta["scoring"]
    lines = [f"scored {info['scored_latents']} latents with {', '.join(info['scorers'])} "
             f"(negatives: {info['negatives']['kinds']}; namers: {', '.join(info['namers'])})",
             format_summary(info["summary"])]
    if info.get("llm_usage_line"):
        lines.append(info["llm_usage_line"])
    return "\n".join(lines)
