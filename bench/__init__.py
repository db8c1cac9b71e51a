"""Side-by-side benchmarks of zerotron against its peers; see bench/README.md."""
