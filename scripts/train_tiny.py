"""Train the bundled tiny model: `python scripts/train_tiny.py --out src/tokenmill/assets/tiny --steps 1000`."""
from tokenmill.tiny.train import main

if __name__ == "__main__":
    main()
