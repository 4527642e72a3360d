"""The main job, end to end on one machine: collect → train → export → bench → decide.

1. collect: `ddte collect` with the pipeline's collect config (training prompts of the prompt builder);
2. train: one selector per verifier in `train.verifiers` (Lightning, tracked in MLflow under the run folder), with
   the never-lose guard fitted on validation prompts;
3. export: each selector to `<output>/selectors/<verifier>.onnx` (parity-checked, logged to MLflow), and, where the
   collection has trunk states and `expander.enabled`, an expander per verifier to `<output>/expanders/<verifier>.onnx`
   (`ddte expander`: per-node halting rules chosen cross-fitted, with a static fallback);
4. bench: on held-out prompts, for each temperature, in one interleaved run: AR, each verifier's static
   candidates (the `bench.candidates` best distinct trees of the training split at that temperature, its selector's
   fallback first), its selector (left out where its guard never leaves the fallback at any temperature, because
   it then drafts exactly the fallback) and its expander (left out where it is static at every temperature);
5. decide: per verifier and temperature, deploy the training split's static choice unless a runner-up beat it
   beyond the bench's noise (a paired bootstrap interval wholly above 1), or the faster of the selector and the
   expander where it beat that static beyond the same noise.
   The choice goes to `<output>/policy.json` (`--policy-file` of `ddte generate` and `ddte bench`).

Why bench several statics, and why a test before leaving the offline choice: the offline ranking can be wrong by more
than the candidates differ, and the bench catches a gross error; but near-tied rows of a small bench differ by noise,
so chasing its fastest row costs more than it gains (results/NOTEBOOK.md, "Small measurements", has the runs).

Every stage's config is read once and checked before the first stage starts (:func:`load_pipeline`). Everything
goes to the `output` folder: data/, mlflow.db, selectors/, expanders/, bench.json, bench.png, policy.json and
results.md.
"""

from ddte.pipeline.config import PipelineConfig, PipelinePlan, load_pipeline, plan_pipeline
from ddte.pipeline.decide import decide, keep_statics, static_candidates
from ddte.pipeline.stages import PipelineResult, run_pipeline

__all__ = ["PipelineConfig", "PipelinePlan", "PipelineResult", "decide", "keep_statics", "load_pipeline",
           "plan_pipeline", "run_pipeline", "static_candidates"]
