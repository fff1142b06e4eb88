"""What people and other tools read: the HTML report of a concept dictionary (``report``) and its scores, the
comparison and diff pages, text for the terminal (``report_text``), and Neuronpedia's import files."""
