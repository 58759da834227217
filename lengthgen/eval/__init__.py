"""Evaluation: the one evaluator (`evaluate`), what runs are evaluated on (`eval_source`), attention
diagnostics, retrieval maps (`needle_map`) and the results model (`RunEval`, `Comparison`, `NeedleMap`) that
reports read."""

from lengthgen.eval.evaluate import EVAL_STREAM, Measure, eval_generator, evaluate, measure_gpt
from lengthgen.eval.needle import DEPTHS, answer_scores, check_needles, measure_needle_gpt, needle_map
from lengthgen.eval.results import (MULTIPLES, SCHEMA, Bucket, Comparison, LengthEval, NeedleCell, NeedleMap,
                                    Provenance, ResultsError, RunEval)
from lengthgen.eval.sources import LongDocuments, eval_source, validation_text

__all__ = ["Bucket", "Comparison", "DEPTHS", "EVAL_STREAM", "LengthEval", "LongDocuments", "MULTIPLES", "Measure",
           "NeedleCell", "NeedleMap", "Provenance", "ResultsError", "RunEval", "SCHEMA", "answer_scores",
           "check_needles", "eval_generator", "eval_source", "evaluate", "measure_gpt", "measure_needle_gpt",
           "needle_map", "validation_text"]
