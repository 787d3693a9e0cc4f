"""Model parallelism: pipeline (zerospeed.parallel.pipeline); tensor, sequence and expert parallelism later."""
