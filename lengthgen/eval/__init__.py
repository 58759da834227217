"""Evaluation: the one evaluator (`evaluate`), what runs are evaluated on (`eval_source`), attention
diagnostics, and the results model (`RunEval`, `Comparison`) that reports read."""

from lengthgen.eval.evaluate import EVAL_STREAM, Measure, eval_generator, evaluate, measure_gpt
from lengthgen.eval.results import (MULTIPLES, SCHEMA, Bucket, Comparison, LengthEval, Provenance, ResultsError,
                                    RunEval)
from lengthgen.eval.sources import LongDocuments, eval_source

__all__ = ["Bucket", "Comparison", "EVAL_STREAM", "LengthEval", "LongDocuments", "MULTIPLES", "Measure",
           "Provenance", "ResultsError", "RunEval", "SCHEMA", "eval_generator", "eval_source", "evaluate",
           "measure_gpt"]
