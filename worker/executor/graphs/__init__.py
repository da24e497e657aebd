"""executor/graphs"""
