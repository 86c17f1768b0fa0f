"""The quick start: a small convnet on scikit-learn's bundled handwritten digits."""
