"""Graph passes over ATen FX graphs (installed as ``zerofx.passes``); see ``pipeline.py``."""

from zerofx.passes.pipeline import PASS_NAMES, Pass, PassContext, default_pipeline, run_pipeline

__all__ = ["PASS_NAMES", "Pass", "PassContext", "default_pipeline", "run_pipeline"]
