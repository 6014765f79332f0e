"""Online evals: metrics, the evaluator process, and what the OnlineEval callback starts."""
