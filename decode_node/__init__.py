"""decode_node"""
