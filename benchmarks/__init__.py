"""offload's benchmark suite: one script per question, each with --quick and --json PATH."""
