// ESLint flat config for the dashboard's script (healthlog.APP_JS), which
// tests/test_dashboard_lint.py extracts and lints, with the snippets this config must refuse.
// No imports: the eslint package is installed outside the repository (.ci/run), so this
// file names its rules and globals itself. ecmaVersion 2017 makes any later syntax a parse
// error: the page is plain ES2017 for the browsers a phone or a NAS still runs.
export default [
  {
    files: ["**/*.js"],
    languageOptions: {
      ecmaVersion: 2017,
      sourceType: "script",
      globals: {
        window: "readonly", document: "readonly", fetch: "readonly", Intl: "readonly",
        URLSearchParams: "readonly", AbortController: "readonly", Option: "readonly",
        setTimeout: "readonly", clearTimeout: "readonly",
      },
    },
    linterOptions: { reportUnusedDisableDirectives: "error" },
    rules: {
      // eslint:recommended's checks for real errors
      "constructor-super": "error", "for-direction": "error", "getter-return": "error",
      "no-async-promise-executor": "error", "no-class-assign": "error",
      "no-compare-neg-zero": "error", "no-cond-assign": "error", "no-const-assign": "error",
      "no-constant-condition": "error", "no-control-regex": "error", "no-debugger": "error",
      "no-dupe-args": "error", "no-dupe-class-members": "error", "no-dupe-else-if": "error",
      "no-dupe-keys": "error", "no-duplicate-case": "error", "no-empty": "error",
      "no-empty-character-class": "error", "no-empty-pattern": "error",
      "no-ex-assign": "error", "no-fallthrough": "error", "no-func-assign": "error",
      "no-global-assign": "error", "no-import-assign": "error", "no-inner-declarations": "error",
      "no-invalid-regexp": "error", "no-irregular-whitespace": "error",
      "no-loss-of-precision": "error", "no-misleading-character-class": "error",
      "no-new-symbol": "error", "no-obj-calls": "error", "no-prototype-builtins": "error",
      "no-redeclare": "error", "no-regex-spaces": "error", "no-self-assign": "error",
      "no-self-compare": "error", "no-setter-return": "error", "no-shadow-restricted-names": "error",
      "no-sparse-arrays": "error", "no-this-before-super": "error", "no-undef": "error",
      "no-unexpected-multiline": "error", "no-unreachable": "error",
      "no-unsafe-finally": "error", "no-unsafe-negation": "error",
      "no-unsafe-optional-chaining": "error", "no-unused-labels": "error",
      "no-unused-vars": ["error", { args: "none", caughtErrors: "none" }],
      "no-useless-backreference": "error", "no-useless-catch": "error",
      "no-useless-escape": "error", "no-with": "error", "require-yield": "error",
      "use-isnan": "error", "valid-typeof": "error",
      // and a few that keep the script plain and safe
      "strict": ["error", "global"], "no-var": "error", "prefer-const": "error",
      "eqeqeq": ["error", "always"], "no-eval": "error", "no-implied-eval": "error",
      "no-new-func": "error", "no-implicit-globals": "error", "no-shadow": "error",
      "no-use-before-define": ["error", { functions: false, classes: true, variables: true }],
      "no-restricted-properties": ["error",
        { property: "innerHTML", message: "data reaches the page through textContent" },
        { property: "outerHTML", message: "data reaches the page through textContent" }],
      "no-restricted-syntax": ["error",
        { selector: "CallExpression[callee.property.name='insertAdjacentHTML']",
          message: "data reaches the page through textContent" },
        { selector: "CallExpression[callee.property.name='write'][callee.object.name='document']",
          message: "no document.write" }],
    },
  },
];
