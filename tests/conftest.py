import os

# Quiet TensorFlow's C++ start-up chatter in test output; set before import.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
