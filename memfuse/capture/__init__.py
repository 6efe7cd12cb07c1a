"""capture: trace the joint forward+backward graph with AOTAutograd and lower it to memfuse's IR."""
