"""Operations: the GPU host check (`make gpu-check`) and Model Analyzer tuning (`make tune`)."""
