"""The model: loading it, where and in which precision it computes, and one forward pass over a
packed batch.
"""
