"""Optional packages and the machine: whether an extra is installed and the line that says how to install it, MLX's
BLAS on a Linux CPU, matplotlib figures. The speculative loop never imports it."""
