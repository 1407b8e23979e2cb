"""prefill_node"""
