"""Side-by-side speed and memory benchmarks of dplit's clipping engines, non-private training and opacus."""
