"""`attnkit heal`: distil a rewritten model (the student) back toward its source (the teacher).

Modules, one job each: request (options and their checks), pair (is the student a rewrite of the
teacher, what the rewrite changed), memory (the memory plan), data (training text from files), samples
(training text the teacher writes), plan (the data plan: windows to train, validate and score on), run (one
run's shared state), models (accelerator, loading, freeing), scores (the report's "eval": the student before
and after, against the teacher), loss (KL to the teacher, attention-output matching), topk (the teacher's
cached top-k targets), trainable (what trains, LoRA), training (the Trainer's setup and summary), loop (the
training loop on accelerate), sharding (FSDP), resume (resumable run state), output (the healed tensors),
finish (write OUT, score it, manifest), heal (the orchestrator).
"""
