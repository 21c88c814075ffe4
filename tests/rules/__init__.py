"""One test per rule of docs/rules.md that an audit found survived its mutation."""
