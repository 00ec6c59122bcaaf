"""The Gradio UI and the command line."""
