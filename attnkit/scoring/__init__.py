"""What a model scores, alone or against another: the layer below the commands that `attnkit eval` and `probe`
report and that every writing command (convert, retrofit, heal) puts in its report.

- perplexity: perplexity of a model on token windows, KL to a reference and top-1 agreement.
- passkey, tasks: pass-key retrieval at long contexts; task accuracy through lm-eval.
- capability: the two together (one spec, checked before a model loads), side by side for two models.
- attention_stats: per-head attention statistics of a model on windows, and two models' summary side by side.
- options: EvalOptions, what a writing command scores (--eval text, greedy samples, tasks, pass keys).
- comparison: a result against its source on those options (the "eval" block of every rewrite's report),
  for loaded models and for checkpoint folders.
"""
