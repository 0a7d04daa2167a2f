"""Complete, reproducible training recipes on real models (data makers and run configs).
May import anything, like bench/."""
