"""What several verbs measure alike: two tensors compared (compare, tensor_diff) and a checkpoint's tensors named by
one digest."""
