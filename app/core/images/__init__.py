"""Image files into what a batch takes: decoded, checked and preprocessed on the CPU, or kept as JPEGs for
the GPU's decoder; and maps drawn over images."""
