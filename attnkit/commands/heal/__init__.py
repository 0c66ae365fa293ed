"""`attnkit heal`: distil a rewritten model (the student) back toward its source (the teacher).

Modules, one job each: request (options and their checks), pair (is the student a rewrite of the
teacher, what the rewrite changed), data (training text from files), samples (training text the
teacher writes), loss (KL to the teacher, attention-output matching), loop (the training loop on
accelerate), checkpoint (resumable run state), output (the healed folder), heal (the orchestrator).
"""
