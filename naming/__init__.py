"""Stage 3: latent -> name, concept bottleneck models, the exported concept dictionary.

Discover, then name: :func:`name_dictionary` streams a store through a dictionary to gather evidence per
latent (top and quantile examples, frequency, histogram, logit lens) and names each latent with a namer
(vocabulary as in Discover-then-Name, context, logit-lens or an LLM). :func:`train_cbm` fits a sparse concept
bottleneck model on the named concepts; :func:`save_concepts`, :func:`save_cbm` and :func:`write_report`
export them.
"""

from conceptdict.naming.bottleneck.cbm import (
    CbmConfig,
    CbmFeatures,
    CbmResult,
    Contribution,
    Intervention,
    class_concepts,
    concept_activations,
    explain_input,
    intervene,
    load_cbm,
    pool_codes,
    save_cbm,
    store_features,
    train_cbm,
)
from conceptdict.naming.bottleneck.features import concept_directions
from conceptdict.naming.concepts import (
    Concept,
    ConceptDictionary,
    DictionaryRef,
    Example,
    dictionary_of,
    is_concept_dir,
    load_concepts,
    save_concepts,
)
from conceptdict.naming.evidence import LatentEvidence, collect_evidence, logit_lens
from conceptdict.naming.llm import LlmConfig, LlmNamer
from conceptdict.naming.namers import (
    ContextNamer,
    LogitLensNamer,
    NameResult,
    Namer,
    NamingInputs,
    VocabNamer,
    context_names,
    logit_lens_names,
    vocab_names,
)
from conceptdict.naming.pipeline import NameConfig, Naming, Sources, name_dictionary, open_sources
from conceptdict.naming.reports.report import write_report
from conceptdict.naming.vocab import embed_vocabulary, load_vocabulary
from conceptdict.naming.written import NamedSummary, write_named

__all__ = [
    "CbmConfig", "CbmFeatures", "CbmResult", "Concept", "ConceptDictionary", "ContextNamer", "Contribution",
    "DictionaryRef", "dictionary_of",
    "Example", "Intervention", "LatentEvidence", "LlmConfig", "LlmNamer", "LogitLensNamer", "NameConfig",
    "NameResult", "NamedSummary", "Namer", "Naming", "NamingInputs", "Sources", "VocabNamer", "class_concepts", "collect_evidence",
    "concept_activations", "concept_directions", "context_names", "embed_vocabulary", "explain_input", "intervene",
    "is_concept_dir", "load_cbm",
    "load_concepts", "load_vocabulary", "logit_lens", "logit_lens_names", "name_dictionary", "open_sources",
    "pool_codes", "save_cbm", "save_concepts", "store_features", "train_cbm", "vocab_names", "write_named", "write_report",
]
