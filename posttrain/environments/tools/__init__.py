"""Tool calling: tool-call parsing, built-in tools (calculator, document search) and the `tools`
environment that runs them turn by turn."""
